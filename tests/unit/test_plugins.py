"""load_object: a user's object from a file or a module, one-line errors, and files that never shadow each other."""

from __future__ import annotations

import pytest

from sharpen.plugins import PluginLoadError, load_object


def test_objects_load_from_a_file_relative_to_the_working_directory_or_from_a_module(tmp_path, monkeypatch):
    (tmp_path / "mine.py").write_text("VALUE = 41\ndef bump(x):\n    return x + 1\n")
    monkeypatch.chdir(tmp_path)
    assert load_object("mine.py:bump", what="k")(load_object("mine.py:VALUE", what="k")) == 42
    assert load_object(f"{tmp_path / 'mine.py'}:VALUE", what="k") == 41  # the same module, imported once
    assert load_object("json:dumps", what="k")([1]) == "[1]"


def test_two_files_with_one_name_in_different_folders_are_different_modules(tmp_path):
    for folder, value in (("a", 1), ("b", 2)):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "reward.py").write_text(f"VALUE = {value}\n")
    assert [load_object(f"{tmp_path / f}/reward.py:VALUE", what="k") for f in ("a", "b")] == [1, 2]


def test_a_file_that_fails_to_import_is_not_cached_half_initialised(tmp_path):
    path = tmp_path / "flaky.py"
    path.write_text("import no_such_module_xyz\nVALUE = 1\n")
    with pytest.raises(PluginLoadError, match=r"cannot import it \(ModuleNotFoundError"):
        load_object(f"{path}:VALUE", what="k")
    path.write_text("VALUE = 1\n")
    assert load_object(f"{path}:VALUE", what="k") == 1


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("mine.py", "reward.function = 'mine.py': expected 'path/to/file.py:Name' or 'package.module:Name'"),
        ("missing.py:f", "reward.function = 'missing.py:f': no file /"),
        ("mine.py:nope", "reward.function = 'mine.py:nope': mine.py has no attribute 'nope'"),
        ("broken.py:f", "reward.function = 'broken.py:f': cannot import it (SyntaxError: "),
        ("no_such_module_xyz:f", "cannot import it (ModuleNotFoundError: No module named 'no_such_module_xyz')"),
    ],
)
def test_what_cannot_be_loaded_is_one_line_naming_the_config_key(tmp_path, monkeypatch, spec, message):
    (tmp_path / "mine.py").write_text("VALUE = 1\n")
    (tmp_path / "broken.py").write_text("def f(:\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(PluginLoadError) as info:
        load_object(spec, what="reward.function")
    assert message in str(info.value) and "\n" not in str(info.value)
