"""The reward section of the config: the verifier rubric, extra weighted components, shaping and the hack policy.

Pydantic only, like the rest of `sharpen.config`: a field's docstring is its help text. The score of a rollout is
``correct_weight * correct + format_weight * format`` (the verifier rubric, always present) plus
``weight * score`` of each ``[[reward.components]]`` entry (an LLM judge, a reward model, length shaping, your
own function), each chosen by its ``type``. Building and combining them is `sharpen.rewards.rubric`'s; this
module only checks that a recipe asks for something coherent.
"""

from __future__ import annotations

import re
import warnings
from typing import Annotated, Any, Literal, cast

from pydantic import Field, field_validator, model_validator

from sharpen.config.section import DeprecatedKeyWarning, Section
from sharpen.config.service import TOKEN_ENV, FleetConfig

RESERVED_COMPONENT_NAMES = (
    "correct",
    "format",
    "overlong_penalty",
    "hack_penalty",
    "environment",
    "kl_penalty",
    "mean",
    "std",
    "num_abstained",
    "abstained_fraction",
    "rubric_score",
)
"""Names a component may not take: the verifier rubric's own components, the shaping terms, the score before
component normalisation, and the ``reward/*`` metrics that a component's ``reward/<name>`` metric would overwrite."""

_NAME = re.compile(r"[a-z][a-z0-9_]*")
DEFAULT_CANARY_EVERY = 50
"""The judge canaries' schedule when a recipe has a judge and does not set reward.judge_canary_every (each check
costs one request per canary, about a dozen)."""


class ComponentSection(Section):
    """What every weighted component has: a name (its metric is ``reward/<name>``) and a weight."""

    name: str = ""
    """Name of the component in ``RewardResult.components`` and the ``reward/<name>`` metric (empty: its type)."""
    weight: float = Field(default=1.0, ge=0.0)
    """Its score is multiplied by this and added to the reward; 0 computes and logs it without changing the score.
    When a component with a weight above 0 abstains, the whole reward abstains."""

    @field_validator("name")
    @classmethod
    def _check_name(cls, name: str) -> str:
        if name and not _NAME.fullmatch(name):
            raise ValueError(f"component name {name!r}: use lowercase letters, digits and _ (it names a metric)")
        if name.startswith("status_") or name in RESERVED_COMPONENT_NAMES:
            raise ValueError(
                f"component name {name!r} is taken by the rubric or its metrics "
                f"({', '.join(RESERVED_COMPONENT_NAMES)}, status_*); choose another"
            )
        return name

    @model_validator(mode="before")
    @classmethod
    def _default_name(cls, data: object) -> object:
        """An unnamed component is named after its type."""
        if not isinstance(data, dict):
            return data
        fields = cast(dict[str, Any], data)
        if not fields.get("name") and "type" in cls.model_fields:
            return {**fields, "name": cls.model_fields["type"].default}
        return fields


class JudgeComponentConfig(ComponentSection):
    """An LLM judge on any OpenAI-compatible server (``vllm serve``, hosted APIs) grades each completion; its score
    is the verdict scaled to [0, 1]. An unparseable verdict or an unreachable server abstains."""

    type: Literal["judge"] = "judge"
    base_url: str
    """The server's address, e.g. ``http://127.0.0.1:8000`` or ``http://127.0.0.1:8000/v1``."""
    model: str
    """The model name sent with every request (it names the judge in the verifier and the cache)."""
    api_key_env: str | None = None
    """Environment variable that holds the API key (None: no key is sent). The key itself never goes in a recipe."""
    criteria: str | None = None
    """The rubric the judge grades by, one criterion per line (None: correctness, reasoning and clarity)."""
    min_score: float = 0.0
    """Lowest score of the judge's scale."""
    max_score: float = 10.0
    """Highest score of the judge's scale."""
    max_response_chars: int = Field(default=8000, ge=100)
    """Budget of one completion as the judge sees it (after normalising and quoting); a longer one loses its middle,
    marked where it was cut, and keeps its end, where the final answer is."""
    timeout_s: float = Field(default=60.0, gt=0.0)
    """Longest wait for one judge request; past it (after max_retries retries) the rollout abstains."""
    max_retries: int = Field(default=3, ge=0)
    """Retries of a request that failed on the connection, a timeout, 408, 429 or 5xx (a 4xx is not retried)."""
    cache_path: str | None = None
    """JSONL file of verdicts, read at start and appended to (None: cache in memory only)."""
    canary_threshold: float = Field(default=0.3, ge=0.0, le=1.0)
    """A canary (a known-bad response) scoring above this fraction of the scale raises the canary alert."""
    on_canary_failure: Literal["abstain", "stop"] = "abstain"
    """What a failed canary check (a known-bad response scored above canary_threshold) does until a later check
    passes: ``abstain``: every verdict of this judge abstains (``infra_error``), so a fooled judge trains nothing;
    ``stop``: the run stops with an error naming the judge. Needs reward.judge_canary_every > 0 to act."""

    @model_validator(mode="after")
    def _check_scale(self) -> JudgeComponentConfig:
        if not self.max_score > self.min_score:
            raise ValueError(
                f"judge {self.name!r}: max_score ({self.max_score}) must exceed min_score ({self.min_score})"
            )
        return self


_MOVED_TO_FLEET = {"num_actors": "num_replicas", "cpus_per_actor": "num_cpus", "gpus_per_actor": "num_gpus"}
"""The reward model's Ray keys before every Ray-hosted fleet had one vocabulary, and their names in ``fleet``."""


class RewardModelComponentConfig(ComponentSection):
    """A sequence-classification reward model scores each completion: over HTTP (`sharpen serve-rm`) or on a fleet of
    Ray actors that load it themselves. A failed request abstains."""

    type: Literal["reward_model"] = "reward_model"
    backend: Literal["http", "ray"] = "http"
    """``http``: ask a running ``sharpen serve-rm`` at url. ``ray``: load model_path in the replicas of ``fleet``
    (Ray actors on the run's Ray cluster, or a local Ray instance started for them)."""
    url: str | None = None
    """backend = "http": the address of ``sharpen serve-rm``, e.g. ``http://127.0.0.1:8000``."""
    token_env: str = TOKEN_ENV
    """backend = "http": the environment variable that holds ``sharpen serve-rm``'s shared-secret token (the one it
    was started with)."""
    timeout_s: float = Field(default=60.0, gt=0.0)
    """Longest wait for one request (http) or one call to an actor (ray); past it the rollouts abstain (timeout)."""
    batch_size: int = Field(default=32, ge=1)
    """Completions per request (http) or per actor call (ray)."""
    max_retries: int = Field(default=3, ge=0)
    """backend = "http": retries of a request that failed on the connection, a timeout, a full queue or a failed
    forward (5xx); a 4xx is not retried."""
    model_path: str | None = None
    """backend = "ray": a local folder with the reward model (num_labels = 1) and its tokenizer."""
    max_length: int = Field(default=1024, ge=1)
    """backend = "ray": inputs are cut to their last N tokens (as ``sharpen serve-rm --max-length``)."""
    fleet: FleetConfig = Field(default_factory=FleetConfig)
    """backend = "ray": the replicas that each hold a copy of the model (the scores are stateless: each call goes to
    the least busy one); with ``num_gpus`` above 0 the model runs on CUDA. (``num_actors``, ``cpus_per_actor`` and
    ``gpus_per_actor``, their names before, still load, with a deprecation line.)"""
    start_timeout_s: float = Field(default=600.0, gt=0.0)
    """backend = "ray": longest wait for a replica to start and load the model."""

    @model_validator(mode="before")
    @classmethod
    def _move_actor_keys(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        section = cast(dict[str, Any], data)
        moved = {new: section[old] for old, new in _MOVED_TO_FLEET.items() if old in section}
        if not moved:
            return section
        name = section.get("name") or "reward_model"
        renamed = ", ".join(f"{old} is now fleet.{new}" for old, new in _MOVED_TO_FLEET.items() if old in section)
        warnings.warn(
            f"reward model {name!r}: {renamed}: write them in its fleet (e.g. fleet = {{num_replicas = 2}})",
            DeprecatedKeyWarning,
            stacklevel=2,
        )
        fleet = section.get("fleet", {})
        if isinstance(fleet, FleetConfig):
            fleet = fleet.model_dump(exclude_unset=True)
        if not isinstance(fleet, dict):
            return section  # not a section: the field's own validation says so
        given = cast(dict[str, Any], fleet)
        if clash := sorted(set(moved) & set(given)):
            raise ValueError(f"reward model {name!r}: fleet.{clash[0]} is given twice (once by its old name)")
        rest = {key: value for key, value in section.items() if key not in _MOVED_TO_FLEET}
        return {**rest, "fleet": {**given, **moved}}

    @model_validator(mode="after")
    def _check_backend(self) -> RewardModelComponentConfig:
        if self.backend == "http" and not self.url:
            raise ValueError(
                f'reward model {self.name!r}: backend = "http" needs url (the address of sharpen serve-rm)'
            )
        if self.backend == "ray" and not self.model_path:
            raise ValueError(f'reward model {self.name!r}: backend = "ray" needs model_path (a local model folder)')
        return self


class LengthComponentConfig(ComponentSection):
    """Length shaping: 0 up to target_length, falling linearly to -1 at max_length, -1 beyond. Never abstains."""

    type: Literal["length"] = "length"
    unit: Literal["tokens", "chars"] = "tokens"
    """What is counted: tokens of the policy's tokenizer (the completion text encoded again) or characters."""
    target_length: int = Field(ge=0)
    """Longest completion that costs nothing."""
    max_length: int = Field(ge=1)
    """Length at which the score reaches -1 (and stays)."""

    @model_validator(mode="after")
    def _check_lengths(self) -> LengthComponentConfig:
        if self.max_length <= self.target_length:
            raise ValueError(
                f"length {self.name!r}: max_length ({self.max_length}) must exceed target_length ({self.target_length})"
            )
        return self


class CustomComponentConfig(ComponentSection):
    """Your own reward, a Python callable loaded once at start: ``function(example, completion, **kwargs)``
    returning a float or a `RewardResult` (``score=None`` abstains); or a class, built once with ``**kwargs``, whose
    instances are called ``(example, completion)`` the same way."""

    type: Literal["custom"] = "custom"
    function: str
    """``path/to/file.py:name`` (a path relative to the working directory) or ``package.module:name``."""
    kwargs: dict[str, Any] = Field(default_factory=dict[str, Any])
    """Keyword arguments for the function on every call (for a class: for building it)."""


RewardComponentConfig = Annotated[
    JudgeComponentConfig | RewardModelComponentConfig | LengthComponentConfig | CustomComponentConfig,
    Field(discriminator="type"),
]


class RewardConfig(Section):
    answer_format: Literal["answer_tag", "last_line", "last_number"] = "answer_tag"
    """Where the final answer is read from: ``<answer>...</answer>`` (the last such tag), the last non-empty line,
    or the last number in the text."""
    format_weight: float = Field(default=0.0, ge=0.0)
    """Weight of the format component (the answer was found where it was asked for); 0 logs it only."""
    correct_weight: float = Field(default=1.0, ge=0.0)
    """Weight of the correctness component."""
    components: list[RewardComponentConfig] = Field(default_factory=list[RewardComponentConfig])
    """More weighted parts of the score, one ``[[reward.components]]`` table each with a ``type`` (judge,
    reward_model, length, custom), a weight and the options of that type; see docs/rewards.md."""
    component_normalization: Literal["none", "group"] = "none"
    """How the weighted components make the training score. ``none``: sum_j w_j v_j as they come. ``group`` (GDPO,
    Liu et al. 2026): each weighted component is first normalised within the rollout's group, (v_j - group mean) /
    (group std + 1e-6), so a component with a large scale or spread does not drown the others; the score before
    normalisation is kept as the ``rubric_score`` component, each normalised value as ``normalized/<name>``. Applied
    before overlong and hack shaping; training only (evaluation reports the raw score); needs the Rubric's score
    (not an environment's own reward) and refuses advantage = "remax"."""
    judge_canary_every: int | None = Field(default=None, ge=0)
    """Grade the canaries (known-bad responses) with every judge component at steps 0, N, 2N, ..., log
    ``hack/judge_canary_alert`` and gate a judge that fails them (its ``on_canary_failure``). None: every 50 steps
    when a judge component is configured (a judge is never trusted unchecked); 0: never. A number needs a judge."""
    overlong_buffer_tokens: int = Field(default=0, ge=0)
    """DAPO soft overlong punishment: the last N tokens before rollout.max_new_tokens lower the reward linearly, to
    -overlong_penalty at the limit (0: off)."""
    overlong_penalty: float = Field(default=1.0, ge=0.0)
    """The largest overlong punishment."""
    hack_policy: Literal["screen", "penalise"] = "screen"
    """What happens to a rollout whose reward carries hack flags (exit before asserts, a conftest, a judge canary):
    ``screen`` leaves it out of the gradient and counts it (``hack/num_screened``); ``penalise`` scores it
    -hack_penalty before the advantages."""
    hack_penalty: float = Field(default=1.0, ge=0.0)
    """The score of a flagged rollout under hack_policy = "penalise"."""

    def canary_every_steps(self) -> int:
        """The canary schedule in force: judge_canary_every, or its default when unset (0 without a judge)."""
        if self.judge_canary_every is not None:
            return self.judge_canary_every
        return DEFAULT_CANARY_EVERY if any(c.type == "judge" for c in self.components) else 0

    @model_validator(mode="after")
    def _check_components(self) -> RewardConfig:
        names = [component.name for component in self.components]
        for name in dict.fromkeys(names):
            if names.count(name) > 1:
                raise ValueError(
                    f"{names.count(name)} components are named {name!r}; give each a distinct name (it names the "
                    "component's metric)"
                )
        if self.judge_canary_every and not any(c.type == "judge" for c in self.components):
            raise ValueError(
                f"judge_canary_every = {self.judge_canary_every} needs a judge: add a [[reward.components]] table "
                'with type = "judge"'
            )
        return self
