"""docs/architecture.md's "Where to add a thing" is true for a policy loss: a toy loss with one parameter, added to
a copy of sharpen by editing exactly the files the table names, is configured by its name, validated, and trained
on through the trainer's objective, with nothing else changed."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[2]

SECTION = '''

class ToyLoss(_PolicyLossSection):
    """A toy: plain policy gradient scaled by ``scale``."""

    type: Literal["toy"] = "toy"
    scale: float = Field(default=1.0, gt=0.0)
    """The factor of the policy gradient."""


PolicyLossConfig = Annotated[
'''

FUNCTION = """

def toy_per_token(
    logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *, scale: float
) -> tuple[torch.Tensor, PolicyLossMetrics]:
    per_token, metrics = pg_per_token(logprobs, advantages, mask)
    return scale * per_token, metrics


def compute_policy_loss("""

CASE = """        case ToyLoss():
            return toy_per_token(logprobs, advantages, mask, scale=loss.scale)
        case _:
            assert_never(loss)"""

EDITS: dict[str, list[tuple[str, str]]] = {
    "config/policy_losses.py": [
        ("\n\nPolicyLossConfig = Annotated[\n", SECTION),
        ("| KLCovLoss | PGLoss,", "| KLCovLoss | PGLoss | ToyLoss,"),
    ],
    "trainer/algorithms/policy_losses.py": [
        ("    SAPOLoss,\n)", "    SAPOLoss,\n    ToyLoss,\n)"),
        ("\n\ndef compute_policy_loss(", FUNCTION),
        ("        case _:\n            assert_never(loss)", CASE),
    ],
}
"""The edits that add the toy loss, by file under src/sharpen."""

SCRIPT = """
import json
from collections import defaultdict
from types import SimpleNamespace

import torch

from sharpen.config.loader import load_config
from sharpen.trainer import Trainer
from sharpen.trainer.packing import pack_micro_batch
from sharpen.types import Example, Message, Rollout

example = Example(task_key="t/0", prompt=(Message(role="user", content="q"),), answer="a")
rollouts = [
    Rollout(example=example, prompt_ids=[1, 2], completion_ids=[3, 4, 5],
            completion_logprobs=[-1.0, -2.0, -0.5], versions=[0, 0, 0], sample_index=0, advantage=1.5),
    Rollout(example=example, prompt_ids=[1, 2], completion_ids=[6], completion_logprobs=[-3.0],
            versions=[0], sample_index=1, advantage=-0.5),
]
micro = pack_micro_batch(rollouts, pad_token_id=0, device=torch.device("cpu"))
out = {}
for name, loss in (("toy", '{type = "toy", scale = 3.0}'), ("pg", '"pg"')):
    overrides = [f"trainer.algorithm.policy_loss={loss}", 'trainer.algorithm.off_policy_correction="none"']
    config = load_config(None, overrides)
    backend = SimpleNamespace(device=torch.device("cpu"), num_ranks=1, rank=0)
    objective = Trainer(config.trainer, backend=backend, pad_token_id=0).objective
    logprobs = micro.engine_logprobs.clone().requires_grad_(True)
    value = objective.micro_batch_loss(micro, logprobs, logprobs.detach(), None, 4.0, defaultdict(float))
    value.backward()
    section = config.trainer.algorithm.policy_loss.model_dump()
    out[name] = {"loss": float(value), "grad": logprobs.grad.tolist(), "section": section}
print(json.dumps(out))
"""


def _table_files(row: str) -> set[str]:
    """The files under src/sharpen that the architecture table's row ``row`` names."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    (line,) = [line for line in text.splitlines() if line.startswith(f"| {row} ")]
    touch = line.split("|")[2]
    return {name for name in re.findall(r"`([\w/]+\.py)", touch) if (ROOT / "src" / "sharpen" / name).is_file()}


def test_a_toy_loss_needs_exactly_the_files_the_table_names(tmp_path: Path):
    assert set(EDITS) == _table_files("a policy loss")
    copy = tmp_path / "src" / "sharpen"
    shutil.copytree(ROOT / "src" / "sharpen", copy, ignore=shutil.ignore_patterns("__pycache__"))
    for name, edits in EDITS.items():
        text = (copy / name).read_text()
        for old, new in edits:
            assert text.count(old) == 1, f"{name}: the anchor {old!r} moved; update the test's edits"
            text = text.replace(old, new)
        (copy / name).write_text(text)
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        env={"PYTHONPATH": str(tmp_path / "src"), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["toy"]["section"] == {"type": "toy", "scale": 3.0}
    # token_mean over the 4 loss tokens: pg = -(1.5 (-1 - 2 - 0.5) - 0.5 (-3)) / 4 = 0.9375; the toy is 3x that
    assert abs(out["pg"]["loss"] - 0.9375) < 1e-6
    assert abs(out["toy"]["loss"] - 3 * 0.9375) < 1e-6
    # d loss / d logprob_t = -scale A_t / 4 on each loss token
    assert out["toy"]["grad"][0][-3:] == [-3 * 1.5 / 4] * 3
