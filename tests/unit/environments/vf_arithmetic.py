"""A single-turn verifiers environment for the adapter's tests: a taskset of sums, scored by a ``@vf.reward``
(importable by id ``vf-arithmetic`` while this folder is on ``sys.path``)."""

from __future__ import annotations

import re
from collections.abc import Iterator

import verifiers.v1 as vf

SUMS = [(1, 3), (2, 2), (5, 4), (7, 8), (6, 6), (9, 1)]


class SumData(vf.TaskData):
    answer: str
    info: dict[str, int]


class SumTask(vf.Task[SumData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def correct(self, task: SumData, trace: vf.Trace) -> float:
        numbers = re.findall(r"-?\d+", trace.last_reply)
        return 1.0 if numbers and numbers[-1] == task.answer else 0.0

    @vf.reward(weight=0.0)
    async def brief(self, trace: vf.Trace) -> float:
        return 1.0 if len(trace.last_reply.split()) <= 8 else 0.0


class SumTaskset(vf.Taskset[SumTask, vf.TasksetConfig]):
    def load(self) -> Iterator[SumTask]:
        for a, b in SUMS:
            data = SumData.model_validate(
                {
                    "prompt": f"What is {a} + {b}?",
                    "system_prompt": "Answer with the number.",
                    "answer": str(a + b),
                    "info": {"a": a, "b": b},
                }
            )
            yield SumTask(data, self.config.task)


__all__ = ["SumTaskset"]


def make_env(*, harness: str = "null") -> vf.Env:
    """This environment built by user code, as ``environment.factory`` names one."""
    config = {
        "taskset": {"id": "vf-arithmetic"},
        "agent": {"harness": {"id": harness}, "runtime": {"type": "subprocess"}},
    }
    return vf.load_environment(vf.resolve_env_config(config))
