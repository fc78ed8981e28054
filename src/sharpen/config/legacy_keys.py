"""Recipes of earlier versions keep loading: the flat keys of ``[trainer.algorithm]`` map onto its typed sections.

Before the objective became typed parts, every knob of every loss, estimator, correction and KL form sat flat in
``[trainer.algorithm]`` (``clip_eps_low``, ``sapo_tau_pos``, ``kl_coef``, ``off_policy_cap``, ...). Such a recipe,
or a run directory's resolved config written then, still loads: each flat key moves into the section it belongs
to, and one deprecation line says what the recipe should say instead. A flat key that does not apply to the chosen
section is dropped when it holds its old default (old resolved configs list every key) and is an error otherwise,
as it had no effect before either. Knobs a recipe left out take the new sections' defaults, which are their
papers' (GSPO's clip range is 3e-4/4e-4, no longer PPO's 0.2).

A section may also be given by its name alone (``policy_loss = "gspo"``): that is the section with its defaults.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

from sharpen.config.section import Section


class LegacyKeyError(ValueError):
    """A flat key that cannot move into the chosen section; the message names the key and where it applies."""


@dataclass(frozen=True, slots=True)
class _Move:
    section: str
    """The typed section of ``[trainer.algorithm]`` the key moves into."""
    field: str
    """Its name there."""
    old_default: object
    """Its default before the move: a key at this value that does not apply is dropped silently."""


_MOVES: dict[str, _Move] = {
    "passk_k": _Move("advantage", "k", 1),
    "reinforce_pp_gamma": _Move("advantage", "gamma", 1.0),
    "advantage_std": _Move("advantage", "std", "unbiased"),
    "clip_eps_low": _Move("policy_loss", "clip_eps_low", 0.2),
    "clip_eps_high": _Move("policy_loss", "clip_eps_high", 0.2),
    "dual_clip_c": _Move("policy_loss", "dual_clip_c", None),
    "sapo_tau_pos": _Move("policy_loss", "tau_pos", 1.0),
    "sapo_tau_neg": _Move("policy_loss", "tau_neg", 1.05),
    "gmpo_log_clip_low": _Move("policy_loss", "log_clip_low", 0.4),
    "gmpo_log_clip_high": _Move("policy_loss", "log_clip_high", 0.4),
    "clip_cov_fraction": _Move("policy_loss", "fraction", 2e-4),
    "clip_cov_min": _Move("policy_loss", "cov_min", 1.0),
    "clip_cov_max": _Move("policy_loss", "cov_max", 5.0),
    "kl_cov_fraction": _Move("policy_loss", "fraction", 2e-3),
    "kl_cov_coef": _Move("policy_loss", "coef", 1.0),
    "off_policy_cap": _Move("off_policy_correction", "cap", 2.0),
    "off_policy_low": _Move("off_policy_correction", "low", 0.5),
    "off_policy_high": _Move("off_policy_correction", "high", 2.0),
    "off_policy_reject": _Move("off_policy_correction", "reject", []),
    "off_policy_normalize": _Move("off_policy_correction", "normalize", False),
    "kl_coef": _Move("kl", "coef", 0.0),
    "kl_estimator": _Move("kl", "estimator", "k2"),
    "kl_target": _Move("kl", "target", None),
    "kl_horizon": _Move("kl", "horizon", 10000),
}
"""Every flat key of the old ``AlgorithmConfig`` that moved, with the old default. ``kl_in_reward`` chooses the
KL section's type and is handled apart."""

TYPED_SECTIONS = ("advantage", "policy_loss", "off_policy_correction", "kl")
"""The sections of ``[trainer.algorithm]`` chosen by ``type``, which may be given by the type's name alone (a test
keeps this equal to `AlgorithmConfig`'s discriminated fields)."""

MOVED_ALGORITHM_KEYS = {key: f"{move.section}.{move.field}" for key, move in _MOVES.items()} | {
    "kl_in_reward": "kl.type"
}
"""Each flat key of ``[trainer.algorithm]`` and where it moved (for 'did you mean' hints)."""

_PREFIXED = {"clip_cov_": "clip_cov", "kl_cov_": "kl_cov", "sapo_": "sapo", "gmpo_": "gmpo"}
"""Old key prefixes that name the loss they belong to (``kl_cov_coef`` and ``clip_cov_fraction`` share a field
name in different sections)."""


@dataclass(frozen=True, slots=True)
class TypedSection:
    """One typed section of ``[trainer.algorithm]``: its classes by ``type``, and the type it has when left out."""

    classes: dict[str, type[Section]]
    default: str


def migrate_algorithm_keys(
    algorithm: dict[str, Any], sections: dict[str, TypedSection]
) -> tuple[dict[str, Any], str | None]:
    """``algorithm`` (a raw ``[trainer.algorithm]`` table) with names expanded into tables and flat keys moved into
    their sections, and the deprecation line (None when nothing was flat). ``sections``: the typed sections by
    name. Raises `LegacyKeyError` for a flat key that does not apply."""
    result = dict(algorithm)
    for name in sections:
        if isinstance(result.get(name), str):
            result[name] = {"type": result[name]}
    flat = sorted(key for key in result if key in _MOVES or key == "kl_in_reward")
    if not flat:
        return result, None
    _choose_kl_type(result)
    for key in [key for key in flat if key in result]:
        value = result.pop(key)
        move = _MOVES[key]
        table = cast(dict[str, Any], dict(result.get(move.section) or {}))
        chosen = str(table.get("type", sections[move.section].default))
        classes = sections[move.section].classes
        if chosen not in classes:
            raise LegacyKeyError(f"{move.section}: unknown type {chosen!r}")
        fields = classes[chosen].model_fields
        owner = next((loss for prefix, loss in _PREFIXED.items() if key.startswith(prefix)), None)
        if move.field in fields and owner in (None, chosen):
            if move.field in table:
                raise LegacyKeyError(f"{key} and {move.section}.{move.field} are both set: keep the second")
            table[move.field] = value
            table.setdefault("type", chosen)
            result[move.section] = table
        elif value != move.old_default:
            owners = sorted(t for t, c in classes.items() if move.field in c.model_fields)
            if owner is not None:
                owners = [owner]
            raise LegacyKeyError(
                f"{key} = {value!r} applies to {move.section} = "
                f"{' or '.join(repr(o) for o in owners)}, not {chosen!r}: it had no effect; remove it"
            )
    line = (
        f"trainer.algorithm: the flat keys {', '.join(flat)} are deprecated; they were read as "
        f"{_describe(result, sections)} (write that in the recipe; docs/algorithms.md, Configuration)"
    )
    return result, line


def _choose_kl_type(result: dict[str, Any]) -> None:
    """The old ``kl_coef`` / ``kl_in_reward`` pair picks the KL section: none at coefficient 0, else a loss term or a
    reward penalty."""
    in_reward = bool(result.pop("kl_in_reward", False))
    coef = result.get("kl_coef", 0.0)
    if "kl" in result or not isinstance(coef, int | float):
        return
    if coef == 0:
        if in_reward:
            raise LegacyKeyError("kl_in_reward needs kl_coef > 0")
        for key in ("kl_coef", "kl_estimator", "kl_target", "kl_horizon"):
            value = result.get(key, _MOVES[key].old_default)
            if value != _MOVES[key].old_default:
                raise LegacyKeyError(f"{key} = {value!r} has no effect with kl_coef = 0: remove it")
            result.pop(key, None)
        return
    result["kl"] = {"type": "reward" if in_reward else "loss"}


def _describe(result: dict[str, Any], sections: dict[str, TypedSection]) -> str:
    """The moved sections as TOML inline tables, e.g. ``policy_loss = {type = "gspo", clip_eps_low = 0.0003}``."""
    parts: list[str] = []
    for name in sections:
        table = result.get(name)
        if isinstance(table, dict):
            ordered = sorted(cast(dict[str, Any], table).items(), key=lambda item: item[0] != "type")  # type first
            items = ", ".join(f"{k} = {_toml(v)}" for k, v in ordered)
            parts.append(f"{name} = {{{items}}}")
    return "; ".join(parts)


def _toml(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in cast(list[object], value)) + "]"
    if isinstance(value, dict):
        items = cast(dict[str, object], value).items()
        return "{" + ", ".join(f"{k} = {_toml(v)}" for k, v in items) + "}"
    return repr(value)
