"""The shared vocabulary of sharpen: plain data that crosses layer boundaries.

Everything here is a keyword-only, slotted dataclass of Python scalars and lists, so that any layer (and any
process: Ray actors, engine workers) can build, pickle and inspect it without importing torch. Tensors live only
inside the trainer (`MicroBatch` is built there). This module imports nothing from sharpen.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Literal

PolicyVersion = int
"""Number of trainer optimizer steps applied to the weights that produced a token (0 = the initial weights)."""


@dataclass(kw_only=True, slots=True, frozen=True)
class TextPart:
    """Text inside a message whose content is a sequence of parts (OpenAI's ``{"type": "text", "text": ...}``)."""

    text: str


@dataclass(kw_only=True, slots=True, frozen=True)
class ImagePart:
    """An image inside a message (OpenAI's ``{"type": "image", ...}``): the bytes of an image file (PNG, JPEG: what
    PIL reads) or the path of one, exactly one of the two. Hashable and picklable, so prompts with images can be
    cache keys and cross process boundaries; `Message.to_json` records a digest of the bytes, never the bytes."""

    data: bytes = b""
    path: str = ""

    def __post_init__(self) -> None:
        if bool(self.data) == bool(self.path):
            raise ValueError("ImagePart: give exactly one of data (the image file's bytes) or path")

    def to_json(self) -> dict[str, Any]:
        """``{"type": "image", "path": ...}`` or ``{"type": "image", "sha256": ..., "num_bytes": ...}``."""
        if self.path:
            return {"type": "image", "path": self.path}
        import hashlib

        return {"type": "image", "sha256": hashlib.sha256(self.data).hexdigest(), "num_bytes": len(self.data)}


ContentPart = TextPart | ImagePart


@dataclass(kw_only=True, slots=True, frozen=True)
class Message:
    """One chat message: a string (the common case) or a tuple of text and image parts, in order."""

    role: Literal["system", "user", "assistant", "tool"]
    content: str | tuple[ContentPart, ...]

    @property
    def text(self) -> str:
        """The content's text (its text parts joined, without the images)."""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content if isinstance(part, TextPart))

    @property
    def images(self) -> tuple[ImagePart, ...]:
        """The content's images, in order (none for a string)."""
        if isinstance(self.content, str):
            return ()
        return tuple(part for part in self.content if isinstance(part, ImagePart))

    def to_json(self) -> str | list[dict[str, Any]]:
        """The content as JSON data: the string itself, or one dict per part (`ImagePart.to_json` for images)."""
        if isinstance(self.content, str):
            return self.content
        return [
            part.to_json() if isinstance(part, ImagePart) else {"type": "text", "text": part.text}
            for part in self.content
        ]


def prompt_images(messages: tuple[Message, ...] | list[Message]) -> tuple[ImagePart, ...]:
    """Every image of ``messages``, in the order a chat template renders them."""
    return tuple(image for message in messages for image in message.images)


@dataclass(kw_only=True, slots=True, frozen=True)
class Example:
    """One task instance: the prompt the policy sees and what a reward function needs to score an answer."""

    task_key: str
    """Stable identifier of the task instance, e.g. ``"basic_arithmetic/17"``; unique within a dataset."""
    prompt: tuple[Message, ...]
    answer: str | None = None
    """Reference answer, if the task has one (verifiers may use metadata instead)."""
    metadata: dict[str, Any] = field(default_factory=dict[str, Any])
    """Task-specific data for the reward function (e.g. a reasoning-gym entry)."""

    @property
    def task_hash(self) -> str:
        """Content hash of the prompt and answer: two examples with the same hash pose the same task."""
        import hashlib
        import json

        payload = json.dumps(
            {"prompt": [[m.role, m.to_json()] for m in self.prompt], "answer": self.answer},
            sort_keys=True,
        )
        return hashlib.sha256(payload.encode()).hexdigest()[:16]


class RewardStatus(StrEnum):
    OK = "ok"
    WRONG = "wrong"
    FORMAT_ERROR = "format_error"
    TIMEOUT = "timeout"
    INFRA_ERROR = "infra_error"
    JUDGE_UNPARSEABLE = "judge_unparseable"


@dataclass(kw_only=True, slots=True)
class RewardResult:
    """The verdict on one rollout. ``score is None`` means the reward abstained (left out of the advantages)."""

    score: float | None
    status: RewardStatus
    components: dict[str, float] = field(default_factory=dict[str, float])
    """Named parts of the score (e.g. ``correct``, ``format``), also logged as metrics."""
    verifier: str = ""
    verifier_version: str = ""
    hack_flags: list[str] = field(default_factory=list[str])
    """Names of the reward-hacking signs seen in this rollout (e.g. ``grader_patched``, ``judge_injection``);
    what happens to a flagged rollout is the hack-monitor policy's decision (screen or penalise)."""
    cache_key: str = ""
    """Identifies the verdict's inputs (verifier, version, task, response) for caching; empty when not cached."""
    is_policy_error: bool = False
    """The policy caused a failure of the grading itself (its program hung, crashed, was killed, or broke the
    grader's protocol): scored as a failure, never abstained; the hack monitor watches its rate per task."""
    detail: str = ""
    """Why the verdict is what it is, in words (for debugging runs; never read for scoring)."""


@dataclass(kw_only=True, slots=True)
class TurnRecord:
    """One turn of a multi-turn episode: what the policy did and what the environment answered."""

    action_text: str
    """The text of the policy's turn (what ``Environment.step`` received)."""
    num_action_tokens: int
    observation_ids: list[int]
    """Tokens the episode loop appended after the action (the rendered observation); empty after the last turn."""
    reward: float | None = None
    is_terminated: bool = False
    is_truncated: bool = False
    info: dict[str, Any] = field(default_factory=dict[str, Any])


@dataclass(kw_only=True, slots=True)
class EpisodeRecord:
    """Enough to re-run an episode's environment side (`sharpen replay`): which environment, which seed, and every
    turn. The task itself is the rollout's `Example` (its key and content hash)."""

    environment: str
    environment_version: str
    seed: int
    sandbox_backend: str | None = None
    turns: list[TurnRecord] = field(default_factory=list[TurnRecord])
    stop_reason: str = ""
    """Why the episode ended: terminated, truncated (by the environment), max_turns, max_tokens, length (a turn hit
    its token limit), wall_clock (the environment's time budget ran out) or environment_error (it raised)."""
    error: str = ""
    """The exception an environment raised (stop_reason environment_error)."""

    @property
    def env_reward(self) -> float | None:
        """The sum of the environment's rewards, or None when it gave none (the rubric scores the episode)."""
        rewards = [t.reward for t in self.turns if t.reward is not None]
        return sum(rewards) if rewards else None


@dataclass(kw_only=True, slots=True, frozen=True)
class ExpertRoutes:
    """The experts a Mixture-of-Experts model routed each token of a sequence to, compactly: for every token (prompt
    and completion, in order), per MoE layer, its ``top_k`` expert indices, as bytes in token-major order
    ``[tokens, layers, top_k]``: unsigned bytes (``itemsize`` 1, fewer than 255 experts; 255 marks an unknown
    route) or little-endian int16 (``itemsize`` 2; -1 marks one). An unknown route (a token the engine never ran,
    such as the last one sampled) leaves the trainer's router its own choice. The trainer converts them
    (`sharpen.expert_routes.routes_tensor`)."""

    data: bytes
    num_tokens: int
    num_layers: int
    top_k: int
    itemsize: Literal[1, 2] = 1

    def __post_init__(self) -> None:
        expected = self.num_tokens * self._token_bytes
        if len(self.data) != expected:
            raise ValueError(f"ExpertRoutes: {len(self.data)} bytes for {expected} ([tokens, layers, top_k])")

    @property
    def _token_bytes(self) -> int:
        return self.num_layers * self.top_k * self.itemsize

    def _is_known(self, token: int) -> bool:
        size = self._token_bytes
        unknown = b"\xff" * size  # 255 as a byte, -1 as an int16: both all ones
        return self.data[token * size : (token + 1) * size] != unknown

    def padded_to(self, num_tokens: int) -> ExpertRoutes:
        """These routes with unknown ones for tokens after them, up to ``num_tokens``."""
        if num_tokens < self.num_tokens:
            raise ValueError(f"ExpertRoutes: cannot pad {self.num_tokens} routes to {num_tokens}")
        extra = b"\xff" * ((num_tokens - self.num_tokens) * self._token_bytes)
        return ExpertRoutes(
            data=self.data + extra,
            num_tokens=num_tokens,
            num_layers=self.num_layers,
            top_k=self.top_k,
            itemsize=self.itemsize,
        )

    def extended_by(self, later: ExpertRoutes) -> ExpertRoutes:
        """These routes, continued by ``later``'s (a later call on the same tokens and more: the next turn of an
        episode): a token keeps the route of the first call that ran it; ``later`` gives the rest."""
        if (later.num_layers, later.top_k, later.itemsize) != (self.num_layers, self.top_k, self.itemsize):
            raise ValueError("ExpertRoutes: routes of another model cannot continue these")
        if later.num_tokens < self.num_tokens:
            raise ValueError(f"ExpertRoutes: {later.num_tokens} later routes cannot continue {self.num_tokens}")
        size = self._token_bytes
        known = bytearray(later.data)
        for token in range(self.num_tokens):
            if self._is_known(token):
                known[token * size : (token + 1) * size] = self.data[token * size : (token + 1) * size]
        return ExpertRoutes(
            data=bytes(known),
            num_tokens=later.num_tokens,
            num_layers=self.num_layers,
            top_k=self.top_k,
            itemsize=self.itemsize,
        )


@dataclass(kw_only=True, slots=True)
class Rollout:
    """One trajectory: the prompt tokens, what the engine generated, and what the trainer needs from it."""

    example: Example
    prompt_ids: list[int]
    completion_ids: list[int]
    completion_logprobs: list[float]
    """Behaviour (engine) logprob of each completion token, at temperature 1 after any sampling transforms."""
    images: tuple[ImagePart, ...] = ()
    """The images the prompt ids hold placeholders for, in order (each expanded to the tokens its image takes);
    the engine and the trainer turn them into the model's pixel inputs with the model's image processor."""
    versions: list[PolicyVersion]
    """Policy version that produced each completion token (all equal in synchronous mode)."""
    routes: ExpertRoutes | None = None
    """A Mixture-of-Experts engine's routes of every prompt and completion token (`ExpertRoutes`), for routing replay
    R3 (``trainer.moe.routing_replay = "r3"``); None when the engine returned none."""
    completion_text: str = ""
    is_truncated: bool = False
    """True when generation stopped at the token limit rather than at an end-of-sequence token."""
    loss_mask: list[bool] | None = None
    """Per completion token: True where the policy generated it (trained on), False where the environment appended
    it (tool output, the next user turn). None means every completion token was generated (single-turn)."""
    episode: EpisodeRecord | None = None
    """What the environment did, for replay (None for rollouts made without an environment)."""
    sample_index: int = 0
    """Index of this rollout within its group (0..num_samples-1)."""
    reward: RewardResult | None = None
    token_rewards: list[float] | None = None
    """Per-completion-token reward terms added to the score (e.g. the KL penalty); None when there are none."""
    advantage: float | None = None
    token_advantages: list[float] | None = None
    """Per-trained-token advantages (one per `num_loss_tokens`) from an estimator with per-token returns
    (REINFORCE++); when set, the trainer uses them and ``advantage`` (their mean) only marks the rollout as
    trainable. None: every token gets ``advantage``. Each segment of an agent episode holds its own share."""
    segments: list[Rollout] = field(default_factory=list["Rollout"])
    """Earlier segments of an agent episode that rewrote its history (each a token sequence of its own, without
    reward or episode); they are trained with this rollout's advantage (`with_segments`). Empty for every other
    rollout: this rollout is the episode's last segment."""

    def __post_init__(self) -> None:
        num = len(self.completion_ids)
        if num != len(self.completion_logprobs) or num != len(self.versions):
            raise ValueError(
                f"rollout {self.example.task_key}: {num} completion tokens but "
                f"{len(self.completion_logprobs)} logprobs and {len(self.versions)} versions"
            )
        if self.loss_mask is not None and len(self.loss_mask) != num:
            raise ValueError(
                f"rollout {self.example.task_key}: {num} completion tokens but a loss mask of {len(self.loss_mask)}"
            )

    @property
    def num_loss_tokens(self) -> int:
        """Completion tokens the policy generated (the trained ones). Per-token values the trainer derives (old
        logprobs, KL penalties in ``token_rewards``, GAE targets) hold one entry per such token, in order."""
        return len(self.completion_ids) if self.loss_mask is None else sum(self.loss_mask)

    @property
    def total_score(self) -> float | None:
        """The reward's score plus any per-token reward terms, its earlier segments' included (what the advantages
        see); None if abstained."""
        if self.reward is None or self.reward.score is None:
            return None
        earlier = sum(sum(s.token_rewards or ()) for s in self.segments)
        return self.reward.score + sum(self.token_rewards or ()) + earlier

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)

    @property
    def oldest_version(self) -> PolicyVersion:
        return min(self.versions) if self.versions else 0


def with_segments(rollouts: list[Rollout]) -> list[Rollout]:
    """``rollouts`` with each one's earlier segments before it, given its reward and advantage: the sequences a
    trainer steps on (one per segment), for rollouts whose advantages are set."""
    out: list[Rollout] = []
    for rollout in rollouts:
        for segment in rollout.segments:
            segment.reward, segment.advantage = rollout.reward, rollout.advantage
            out.append(segment)
        out.append(rollout)
    return out


@dataclass(kw_only=True, slots=True)
class RolloutGroup:
    """All rollouts of one example: the unit over which group-relative advantages are computed."""

    example: Example
    rollouts: list[Rollout]
    baseline_score: float | None = None
    """Score of a greedy completion of the example (ReMax's baseline); None when not generated or abstained."""

    @property
    def scores(self) -> list[float | None]:
        """Each rollout's `Rollout.total_score`."""
        return [r.total_score for r in self.rollouts]


@dataclass(kw_only=True, slots=True)
class TrainBatch:
    """The rollouts of one trainer step, with advantages set. Rollouts without an advantage are not trained on."""

    rollouts: list[Rollout]
    step: int
    """The trainer step this batch is for (the policy version it will produce is ``step + 1``)."""
    skip_grad_norm_above: float | None = None
    """Skip every optimizer step of this batch whose gradient norm is above this (a spike; the stability guards'
    ``on_bad_step = "skip"``); None: apply every finite one. The same number on every rank, and the norm is the
    global one, so the ranks skip together."""

    @property
    def num_loss_tokens(self) -> int:
        return sum(r.num_loss_tokens for r in self.rollouts)


@dataclass(kw_only=True, slots=True)
class Completion:
    """What an inference engine returns for one prompt."""

    token_ids: list[int]
    logprobs: list[float]
    text: str = ""
    finish_reason: Literal["stop", "length"] = "stop"
    versions: list[PolicyVersion] | None = None
    """Policy version of each token when they differ (weights updated while it was generated); None: all were
    made by the engine's ``policy_version`` at the end of the call."""
    routes: ExpertRoutes | None = None
    """A Mixture-of-Experts engine's routes of the prompt and the completion tokens (engines that return routes,
    when asked: routing replay R3); None otherwise."""


@dataclass(kw_only=True, slots=True)
class ProbeScores:
    """The trainer's side of the weight-sync probe: the logprobs of the probe's tokens after the first, and the
    experts a Mixture-of-Experts policy routed each token to (when its routes are recorded: ``trainer.moe``), for an
    engine that can replay them; None otherwise."""

    logprobs: list[float]
    routes: ExpertRoutes | None = None


@dataclass(kw_only=True, slots=True, frozen=True)
class SamplingParams:
    """Engine-independent sampling settings."""

    max_new_tokens: int
    temperature: float = 1.0
    """0 means greedy decoding."""
    top_p: float = 1.0
    """Nucleus cut (1: off), after top_k; the engines' logprobs are those of the truncated distribution."""
    top_k: int = 0
    """Top-k cut (0: off), applied after the temperature and before top_p."""
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
