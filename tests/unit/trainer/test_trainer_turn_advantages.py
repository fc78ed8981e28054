"""Turn-level advantages on the tiny random Llama: multi-turn rollouts (observations between the turns masked out)
whose tokens carry their turn's advantage train with the loss those advantages give, and the step's gradient does
not depend on the micro-batch split."""

from __future__ import annotations

import random
import statistics
from pathlib import Path

import pytest

from sharpen.config.advantages import GiGPOAdvantage, TurnGRPOAdvantage
from sharpen.config.algorithm import AlgorithmConfig
from sharpen.config.corrections import NoCorrection
from sharpen.config.schema import TrainerConfig
from sharpen.orchestration.phases import assign_advantages
from sharpen.trainer import Trainer
from sharpen.types import EpisodeRecord, RewardResult, RewardStatus, Rollout, RolloutGroup, TrainBatch, TurnRecord
from support.tiny_trainer import EXAMPLE, PAD, VOCAB, captured_step, single_device_trainer


def _episodes(seed: int, num: int = 6, group_size: int = 3) -> list[RolloutGroup]:
    """Groups of random 1-3 turn episodes: 1-4 action tokens a turn, a 1-2 token observation after every turn but the
    last (drawn from two, so that states repeat), reward 1 on a last turn one time in two."""
    rng = random.Random(seed)
    groups = []
    for start in range(0, num, group_size):
        rollouts = []
        for _ in range(group_size):
            num_turns = rng.randint(1, 3)
            completion: list[int] = []
            mask: list[bool] = []
            turns = []
            for index in range(num_turns):
                action = [rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 4))]
                observation = [] if index == num_turns - 1 else rng.choice([[7], [8, 9]])
                reward = float(rng.random() < 0.5) if index == num_turns - 1 else 0.0
                completion += action + observation
                mask += [True] * len(action) + [False] * len(observation)
                record = TurnRecord(action_text="", num_action_tokens=len(action), observation_ids=observation)
                record.reward = reward
                turns.append(record)
            score = sum(t.reward or 0.0 for t in turns)
            rollouts.append(
                Rollout(
                    example=EXAMPLE,
                    prompt_ids=[rng.randrange(1, VOCAB) for _ in range(3)],
                    completion_ids=completion,
                    completion_logprobs=[-4.85] * len(completion),
                    versions=[0] * len(completion),
                    loss_mask=mask,
                    episode=EpisodeRecord(environment="e", environment_version="1", seed=start, turns=turns),
                    reward=RewardResult(score=score, status=RewardStatus.OK),
                    sample_index=len(rollouts),
                )
            )
        groups.append(RolloutGroup(example=EXAMPLE, rollouts=rollouts))
    return groups


def _config(estimator, micro_batch_size: int = 6) -> TrainerConfig:
    algorithm = AlgorithmConfig(advantage=estimator, off_policy_correction=NoCorrection())
    return TrainerConfig(
        device="cpu", precision="float32", learning_rate=1e-3, micro_batch_size=micro_batch_size, algorithm=algorithm
    )


@pytest.mark.parametrize("estimator", [GiGPOAdvantage(gamma=0.5), TurnGRPOAdvantage(gamma=0.5)])
def test_turn_advantages_train_their_turns_tokens_whatever_the_micro_batch_split(
    model_dir: Path, monkeypatch, estimator
):
    groups = _episodes(seed=3)
    assign_advantages(groups, AlgorithmConfig(advantage=estimator))
    rollouts = [r for g in groups for r in g.rollouts]
    per_token = [a for r in rollouts for a in r.token_advantages or []]
    assert len(per_token) == sum(r.num_loss_tokens for r in rollouts)
    assert len({round(a, 9) for r in rollouts for a in r.token_advantages or []}) > 2  # not one value per episode
    batch = TrainBatch(rollouts=rollouts, step=0)
    backend = single_device_trainer(_config(estimator), model_dir).backend
    gradients = {}
    for size in (6, 2, 1):
        trainer = Trainer(_config(estimator, size), backend=backend, pad_token_id=PAD)
        metrics, gradients[size] = captured_step(trainer, batch, monkeypatch)
        # on-policy, no correction: ppo_clip's token loss is -A_t and token_mean averages it over the trained tokens
        assert metrics["train/loss"] == pytest.approx(-statistics.fmean(per_token), abs=1e-5)
    whole = gradients[6]
    assert max(g.abs().max().item() for g in whole.values()) > 1e-4  # a real gradient, not all zeros
    for size in (2, 1):
        for name, grad in gradients[size].items():
            diff = (grad - whole[name]).abs().max().item()
            assert diff < 1e-5, f"micro_batch_size={size}: {name} differs by {diff}"
