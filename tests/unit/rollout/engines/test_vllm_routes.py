"""R3 from vLLM, without a running engine (vLLM's CPU build cannot return routes, docs/moe.md): the engine asks vLLM
for them (`enable_return_routed_experts`, an argument vLLM's `EngineArgs` takes), and each completion's routes come
from vLLM 0.32's own output types: `CompletionOutput.routed_experts` in process, and a server's base64 ``.npy``
made by vLLM's own encoder. vLLM returns every token it ran (prompt and completion but the last sampled token);
the rollout's routes are those rows and an unknown last token."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import torch

from sharpen.config.engines import VllmEngineConfig
from sharpen.expert_routes import UNROUTED, routes_tensor
from sharpen.rollout.engines.base import EngineError
from sharpen.rollout.engines.vllm import engine_arguments, vllm_completion
from sharpen.rollout.engines.vllm_routes import RoutesOf, decode_routed, vllm_routes

PROMPT, GENERATED, LAYERS, TOP_K, EXPERTS = 5, 3, 2, 2, 8


def _rows() -> np.ndarray:
    """vLLM's routed experts of a request: ``[prompt + generated - 1, layers, top_k]`` (uint8, as vLLM returns
    them for fewer than 256 experts)."""
    rng = np.random.default_rng(0)
    return np.stack(
        [[rng.permutation(EXPERTS)[:TOP_K] for _ in range(LAYERS)] for _ in range(PROMPT + GENERATED - 1)]
    ).astype(np.uint8)


def _sample(routed: np.ndarray | None):
    from vllm.logprobs import Logprob
    from vllm.outputs import CompletionOutput

    ids = [11, 12, 2]
    return CompletionOutput(
        index=0,
        text="abc",
        token_ids=ids,
        cumulative_logprob=None,
        logprobs=[{token: Logprob(logprob=-0.5)} for token in ids],
        routed_experts=routed,
        finish_reason="stop",
    )


def test_a_completion_carries_the_routes_vllm_returned_and_an_unknown_last_token():
    rows = _rows()
    completion = vllm_completion(_sample(rows), routes_of=RoutesOf(prompt_length=PROMPT, num_experts=EXPERTS))
    assert completion.routes is not None
    routes = routes_tensor(completion.routes)
    assert tuple(routes.shape) == (PROMPT + GENERATED, LAYERS, TOP_K)
    assert torch.equal(routes[:-1], torch.from_numpy(rows.astype(np.int64)))
    assert bool((routes[-1] == UNROUTED).all())
    assert vllm_completion(_sample(rows)).routes is None  # not asked for (no R3)


def test_missing_or_misshapen_routes_are_one_clear_error():
    with pytest.raises(EngineError, match=r"vLLM returned no routed experts: .* enable_return_routed_experts"):
        vllm_completion(_sample(None), routes_of=RoutesOf(prompt_length=PROMPT, num_experts=EXPERTS))
    with pytest.raises(EngineError, match=r"routed experts of shape \(6, 2, 2\) for 8 tokens \(expected \[7, layers"):
        vllm_routes(_rows()[1:], num_tokens=PROMPT + GENERATED, num_experts=EXPERTS)


def test_a_server_reply_s_routes_decode_from_vllm_s_own_encoding():
    from vllm.utils.serial_utils import numpy2base64

    rows = _rows()
    decoded = decode_routed(numpy2base64(rows))
    assert decoded.dtype == rows.dtype
    assert np.array_equal(decoded, rows)
    with pytest.raises(ValueError):
        decode_routed("not base64 !")
    pickled = io.BytesIO()
    np.save(pickled, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(ValueError):  # an object array would need unpickling: refused
        decode_routed(base64.b64encode(pickled.getvalue()).decode())


def test_the_engine_asks_vllm_for_routes_only_under_r3(tmp_path):
    from vllm.engine.arg_utils import EngineArgs

    config = VllmEngineConfig()
    plain = engine_arguments(config, model_path=tmp_path, dtype="float32", seed=0, sleep_mode=False)
    routed = engine_arguments(
        config, model_path=tmp_path, dtype="float32", seed=0, sleep_mode=False, return_routes=True
    )
    assert "enable_return_routed_experts" not in plain
    assert routed["enable_return_routed_experts"] is True
    assert EngineArgs(model=str(tmp_path), enable_return_routed_experts=True).enable_return_routed_experts
