"""The off-policy corrections of ``trainer.algorithm.off_policy_correction``: how the loss is corrected against the
engine's (behaviour) logprobs, one section per correction, chosen by ``type``, and the rejection criteria any of
them can chain (``reject``).

Adding a correction: its section here (and in `CorrectionConfig`), its function and ``case`` in
``trainer/algorithms/offpolicy.py: compute_correction``, and a test. docs/algorithms.md gives each form.
"""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from pydantic import Field, model_validator

from sharpen.config.section import Section


class OffPolicyRejectConfig(Section):
    """One rejection criterion of off_policy_correction.reject, on the per-token divergence between the trainer's
    old policy and the engine's, with r_t = pi_old(y_t) / pi_engine(y_t): k1 = log r_t, k2 = 0.5 (log r_t)^2, k3 =
    (r_t - 1) - log r_t. A token criterion tests each token's divergence; a sequence criterion tests the sum, mean
    or max of its tokens' divergences and keeps or drops the whole sequence. docs/algorithms.md gives each form."""

    level: Literal["token", "sequence"]
    """What a failed test drops: the token, or every token of the sequence."""
    statistic: Literal["sum", "mean", "max"] | None = None
    """Sequence criteria only (required there): the sequence's statistic of its tokens' divergences. With k1, sum
    tests the product ratio prod_t r_t and mean the geometric-mean ratio exp(mean_t log r_t); max needs k2 or k3."""
    divergence: Literal["k1", "k2", "k3"] = "k1"
    """Per-token divergence: k1 (log ratio, signed: tested as a ratio band [low, high]), or the non-negative k2 /
    k3 (tested against the upper threshold high)."""
    low: float | None = Field(default=None, ge=0.0, le=1.0)
    """k1 only (required there): the lowest kept ratio (exp of the statistic); 0 means no lower bound."""
    high: float = Field(gt=0.0)
    """k1: the highest kept ratio (at least 1); k2 / k3: the largest kept divergence (or statistic of them)."""

    @property
    def name(self) -> str:
        """The criterion's name in metrics: ``token_k1``, ``seq_mean_k1``, ``seq_max_k3``, ..."""
        return f"token_{self.divergence}" if self.level == "token" else f"seq_{self.statistic}_{self.divergence}"

    @model_validator(mode="after")
    def _check_form(self) -> OffPolicyRejectConfig:
        if self.level == "token" and self.statistic is not None:
            raise ValueError('statistic applies to level = "sequence" only (a token is tested on its own divergence)')
        if self.level == "sequence" and self.statistic is None:
            raise ValueError('level = "sequence" needs statistic = "sum", "mean" or "max"')
        if self.divergence == "k1":
            if self.statistic == "max":
                raise ValueError('statistic = "max" needs divergence = "k2" or "k3" (k1 is signed: use a k1 band)')
            if self.low is None:
                raise ValueError("a k1 criterion needs low (its ratio band is [low, high]; low = 0: no lower bound)")
            if self.high < 1.0:
                raise ValueError(f"a k1 criterion needs high >= 1 (a ratio of 1 must be kept), got high = {self.high}")
        elif self.low is not None:
            raise ValueError(f"low applies to k1 only: {self.divergence} is non-negative, give only its threshold high")
        return self


class _CorrectionSection(Section):
    weights_per_sequence: ClassVar[bool] = False
    """Every token of a sequence gets its sequence's weight (normalised per sequence)."""

    reject: list[OffPolicyRejectConfig] = Field(default_factory=list[OffPolicyRejectConfig])
    """Rejection criteria applied on top of the correction (empty: none): a token stays in the loss only if every
    criterion keeps it; rejected tokens and sequences get weight 0 and leave the loss mask, the others keep the
    correction's weight. E.g. ``[{level = "token", low = 0.5, high = 2.0}, {level = "sequence", statistic =
    "max", divergence = "k3", high = 1.0}]``."""

    def normalizes_weights(self) -> bool:
        """Whether the importance weights are divided by their mini-batch mean (only corrections with weights)."""
        return False

    @model_validator(mode="after")
    def _check_reject(self) -> _CorrectionSection:
        names = [criterion.name for criterion in self.reject]
        if repeated := sorted({name for name in names if names.count(name) > 1}):
            raise ValueError(
                f"reject lists {', '.join(repeated)} more than once: merge their bounds into one criterion"
            )
        return self


class _WeightingSection(_CorrectionSection):
    normalize: bool = False
    """Divide the importance weights by their mean over the kept tokens (token_tis, icepop) or kept sequences
    (sequence_tis) of the whole mini-batch, so that they average 1: less variance, a small bias. Needs the trainer's
    old logprobs before the first micro-batch (one extra forward pass without gradient when num_epochs and
    num_mini_batches are 1)."""

    def normalizes_weights(self) -> bool:
        return self.normalize


class _BandSection(_CorrectionSection):
    low: float = Field(default=0.5, ge=0.0)
    """Lower edge of the kept ratio band."""
    high: float = Field(default=2.0, gt=0.0)
    """Upper edge of the kept ratio band."""

    @model_validator(mode="after")
    def _check_band(self) -> _BandSection:
        if self.low > self.high:
            raise ValueError(f"low = {self.low} is above high = {self.high}")
        return self


class NoCorrection(_CorrectionSection):
    """No correction: every token weighs 1 (the mismatch metrics are still logged)."""

    type: Literal["none"] = "none"


class TokenTISCorrection(_WeightingSection):
    """Truncated importance sampling per token (Yao et al. 2025): weight min(r_t, cap). sharpen's default: the
    engine's numerics never exactly match the trainer's."""

    type: Literal["token_tis"] = "token_tis"
    cap: float = Field(default=2.0, gt=0.0)
    """Truncation of the importance weight (the paper's C = 2)."""


class SequenceTISCorrection(_WeightingSection):
    """Truncated importance sampling per sequence: every token gets min(prod_t r_t, cap)."""

    weights_per_sequence: ClassVar[bool] = True
    type: Literal["sequence_tis"] = "sequence_tis"
    cap: float = Field(default=2.0, gt=0.0)
    """Truncation of the sequence's importance weight."""


class TokenMaskCorrection(_BandSection):
    """Token-level rejection (masked importance sampling): keep a token, with weight 1, only when its ratio lies in
    [low, high]."""

    type: Literal["token_mask"] = "token_mask"


class IcePopCorrection(_BandSection, _WeightingSection):
    """IcePop (Ling Team 2025): weight r_t inside [low, high], 0 (and masked out) outside."""

    type: Literal["icepop"] = "icepop"


class SequenceMaskCorrection(_BandSection):
    """Keep a whole sequence, with weight 1, only when its geometric-mean ratio exp(mean_t log r_t) lies in
    [low, high]."""

    type: Literal["sequence_mask"] = "sequence_mask"


CorrectionConfig = Annotated[
    NoCorrection
    | TokenTISCorrection
    | SequenceTISCorrection
    | TokenMaskCorrection
    | IcePopCorrection
    | SequenceMaskCorrection,
    Field(discriminator="type"),
]
"""``trainer.algorithm.off_policy_correction``: a table with ``type``, or the name alone with its defaults."""
