"""resolve_model_path: known names, local folders, and the messages that say what to do."""

from __future__ import annotations

import pytest

from sharpen.config.models import KNOWN_MODELS, ModelNotFoundError, cached_model_dir, resolve_model_path

_NAME = "smollm2-135m-instruct"


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARPEN_CACHE", str(tmp_path / "cache"))


def test_nonexistent_path_lists_the_known_models(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model_path(str(missing))
    message = str(info.value)
    assert message.startswith(f"model.path: {str(missing)!r} does not exist")
    assert all(name in message for name in KNOWN_MODELS)


def test_folder_without_config_json_is_not_a_model(tmp_path):
    folder = tmp_path / "weights"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelNotFoundError, match=r"has no config\.json, so it is not a HF model folder"):
        resolve_model_path(str(folder))


def test_local_model_folder_resolves_to_itself(tmp_path):
    folder = tmp_path / "weights"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    assert resolve_model_path(str(folder)) == folder


def test_known_name_not_pulled_says_how_to_pull(tmp_path):
    assert _NAME in KNOWN_MODELS
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model_path(_NAME)
    assert str(info.value) == f"model.path: {_NAME!r} is not pulled yet; run `sharpen models pull {_NAME}`"


def test_known_name_resolves_to_the_cache_once_pulled(tmp_path):
    folder = cached_model_dir(_NAME)
    assert folder == tmp_path / "cache" / "models" / _NAME
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    assert resolve_model_path(_NAME) == folder
