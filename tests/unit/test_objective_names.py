"""No advantage estimator, policy loss, off-policy correction or KL form is matched by its name outside its own
modules: the rest of sharpen asks the part's section (its class, or a property such as ``needs_critic``), so adding
a part never means hunting for string comparisons."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import get_args

from sharpen.config.advantages import AdvantageConfig
from sharpen.config.corrections import CorrectionConfig
from sharpen.config.kl import KLConfig
from sharpen.config.policy_losses import PolicyLossConfig

SRC = Path(__file__).parents[2] / "src" / "sharpen"
OWN_MODULES = {
    "config/advantages.py",
    "config/policy_losses.py",
    "config/corrections.py",
    "config/kl.py",
    "config/legacy_keys.py",  # maps the flat keys of earlier recipes, which name losses by prefix
    "trainer/algorithms/estimators.py",
    "trainer/algorithms/policy_losses.py",
    "trainer/algorithms/offpolicy.py",
    "trainer/algorithms/kl.py",
}
SECTION_WORDS = ("advantage", "policy_loss", "correction", "kl")


def _tags(union: object) -> set[str]:
    return {get_args(member.model_fields["type"].annotation)[0] for member in get_args(get_args(union)[0])}


TAGS = _tags(AdvantageConfig) | _tags(PolicyLossConfig) | _tags(CorrectionConfig) | _tags(KLConfig)
GENERIC = {"none", "loss", "reward"}
"""Tags that are ordinary words elsewhere: flagged only when compared with something named after a part."""


def _strings(node: ast.expr) -> set[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return {s for element in node.elts for s in _strings(element)}
    return set()


def name_matches(source: str) -> list[str]:
    """``line: text`` of every comparison or ``case`` that matches a part's name as a string in ``source``."""
    found: list[str] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            names = {s for operand in operands for s in _strings(operand)} & TAGS
            others = " ".join(ast.unparse(o) for o in operands if not _strings(o))
            if names - GENERIC or (names and any(word in others for word in SECTION_WORDS)):
                found.append(f"{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.MatchValue) and _strings(node.value) & (TAGS - GENERIC):
            found.append(f"{node.value.lineno}: case {ast.unparse(node.value)}")
    return found


def test_the_matcher_sees_a_name_compared_as_a_string():
    source = (
        'if config.advantage == "gae":\n    pass\nif loss in ("gspo", "gmpo"):\n    pass\nif kl.type == "none": pass\n'
    )
    assert [line.split(":")[0] for line in name_matches(source)] == ["1", "3", "5"]
    assert name_matches('if policy == "none": pass\nif status == "reward": pass\n') == []


def test_no_part_is_matched_by_name_outside_its_own_modules():
    offenders = []
    for path in sorted(SRC.rglob("*.py")):
        relative = path.relative_to(SRC).as_posix()
        if relative in OWN_MODULES:
            continue
        offenders += [f"{relative}:{match}" for match in name_matches(path.read_text())]
    assert not offenders, "ask the section (its class or a property), not its name:\n" + "\n".join(offenders)
