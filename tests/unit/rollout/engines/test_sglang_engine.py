"""The sglang engine against a stand-in SGLang server (tests/support/sglang_standin.py: SGLang's schemas in front of
a real HfEngine on the tiny model), one per module: generation gives the tokens and logprobs of the HfEngine with
the same seeds, alone, in a batch and concurrently; scoring and weight syncs match the trainer's logprobs; and each
kind of bad input (nothing listening, a server of another kind, the wrong model, a port in use, a server that stops
answering, no sglang installed) is one clear EngineError. The `gpu` test runs the engine against a real SGLang."""

from __future__ import annotations

import asyncio
import http.server
import importlib.util
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

import sharpen.rollout.engines.sglang as sglang_module
from sharpen.config.engines import SglangEngineConfig
from sharpen.rollout.engines import AsyncEngine, EngineError, EngineUnavailable, RestartableEngine, SleepableEngine
from sharpen.rollout.engines.hf import HfEngine
from sharpen.rollout.engines.server import free_port
from sharpen.rollout.engines.sglang import ABORT_RETRIES, SglangEngine
from sharpen.types import Completion, SamplingParams
from support.sglang_standin import SglangStandin

STANDIN = Path(__file__).parents[3] / "support" / "sglang_standin.py"
PROMPTS = [[1, 5, 9, 200, 300], [1, 7], [1, 8, 9, 10, 11, 12, 13], [1, 42, 43]]


@pytest.fixture(scope="module")
def standin(tiny_model_path: Path) -> Iterator[SglangStandin]:
    server = SglangStandin(tiny_model_path)
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def reference(tiny_model_path: Path) -> HfEngine:
    return HfEngine(tiny_model_path)


def connect(standin: SglangStandin, model_path: Path, **config: object) -> SglangEngine:
    timeout = config.pop("request_timeout_s", 30.0)
    assert isinstance(timeout, float)
    return SglangEngine(
        SglangEngineConfig.model_validate({"url": standin.url, **config}),
        model_path=model_path,
        dtype="float32",
        seed=0,
        request_timeout_s=timeout,
    )


@pytest.fixture(scope="module")
def engine(standin: SglangStandin, tiny_model_path: Path) -> Iterator[SglangEngine]:
    engine = connect(standin, tiny_model_path)
    yield engine
    engine.close()


def sampled(seeds: tuple[int, ...] = (11, 22, 33, 44)) -> list[SamplingParams]:
    return [SamplingParams(max_new_tokens=8, temperature=0.9, seed=seed) for seed in seeds]


def test_generate_gives_the_hf_engines_tokens_and_logprobs_with_the_same_seeds(
    engine: SglangEngine, reference: HfEngine
) -> None:
    params = sampled()
    batch = engine.generate(PROMPTS, params)
    alone = [reference.generate([prompt], [param])[0] for prompt, param in zip(PROMPTS, params, strict=True)]
    assert [c.token_ids for c in batch] == [c.token_ids for c in alone]
    for ours, theirs in zip(batch, alone, strict=True):
        assert ours.logprobs == pytest.approx(theirs.logprobs, abs=1e-5)
        assert ours.finish_reason == theirs.finish_reason
        assert ours.text == theirs.text
        assert ours.versions == [0] * len(ours.token_ids)
    assert engine.server_version == "0.5.23"
    assert isinstance(engine, AsyncEngine) and isinstance(engine, SleepableEngine)


def test_greedy_generation_and_its_finish_reasons(engine: SglangEngine, reference: HfEngine) -> None:
    greedy = SamplingParams(max_new_tokens=4, temperature=0.0)
    [long] = engine.generate([PROMPTS[0]], [greedy])
    assert long.finish_reason == "length" and len(long.token_ids) == 4
    assert long.token_ids == reference.generate([PROMPTS[0]], [greedy])[0].token_ids
    stop = SamplingParams(max_new_tokens=4, temperature=0.0, stop_token_ids=(long.token_ids[-1],))
    [stopped] = engine.generate([PROMPTS[0]], [stop])
    num = long.token_ids.index(long.token_ids[-1]) + 1  # up to the stop token's first place, which is kept
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == long.token_ids[:num]
    assert stopped.logprobs == pytest.approx(long.logprobs[:num], abs=1e-5)


def test_concurrent_requests_from_an_event_loop(engine: SglangEngine, reference: HfEngine) -> None:
    params = sampled((5, 6, 7, 8))

    async def episodes() -> list[Completion]:
        requests = [engine.generate_async(p, q) for p, q in zip(PROMPTS * 2, params * 2, strict=True)]
        return list(await asyncio.gather(*requests))

    completions = asyncio.run(episodes())
    expected = [reference.generate([p], [q])[0].token_ids for p, q in zip(PROMPTS, params, strict=True)]
    assert [c.token_ids for c in completions] == expected * 2
    assert all(c.versions == [0] * len(c.token_ids) for c in completions)


def test_score_is_the_hf_engines(engine: SglangEngine, reference: HfEngine) -> None:
    ids = PROMPTS[2] + [77, 78, 79]
    assert engine.score(ids) == pytest.approx(reference.score(ids), abs=1e-5)
    assert engine.score([1]) == []


def test_token_versions_come_from_sglangs_weight_version_spans(engine: SglangEngine) -> None:
    """A request that spans a weight update (the stand-in's never do) reports two spans in ``meta_info``."""
    spans = [{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 2, "end": 5}]
    assert engine._versions({"weight_versions": spans, "weight_version": "4"}, 5, 0) == [3, 3, 4, 4, 4]
    assert engine._versions({"weight_version": "4"}, 2, 0) == [4, 4]  # no spans: the answer's one version
    assert engine._versions({}, 2, 7) == [7, 7]  # neither: the engine's when it sent the request
    with pytest.raises(EngineError, match="reports weight version 'default'"):
        engine._versions({"weight_versions": [{"version": "default", "start": 0, "end": 1}]}, 1, 0)


def test_an_aborted_request_is_sent_again_until_the_retries_run_out(
    standin: SglangStandin, engine: SglangEngine, reference: HfEngine
) -> None:
    [param] = sampled((3,))
    standin.abort_next(ABORT_RETRIES)
    [completion] = engine.generate([PROMPTS[1]], [param])
    assert completion.token_ids == reference.generate([PROMPTS[1]], [param])[0].token_ids
    standin.abort_next(ABORT_RETRIES + 1)
    with pytest.raises(EngineError, match=f"aborted a request {ABORT_RETRIES + 1} times"):
        engine.generate([PROMPTS[1]], [param])


def trainer_logprobs(model: torch.nn.Module, ids: list[int]) -> list[float]:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(ids[1:]).unsqueeze(-1)).squeeze(-1).tolist()


@pytest.fixture()
def perturbed(tiny_model_path: Path) -> torch.nn.Module:
    """The tiny model with seeded noise on every weight (what a trainer step would send)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=generator))
    return model


def test_load_weights_pauses_loads_and_reports_the_version(
    standin: SglangStandin, tiny_model_path: Path, perturbed: torch.nn.Module
) -> None:
    engine = connect(standin, tiny_model_path)
    ids = PROMPTS[2] + [77, 78]
    try:
        before = engine.score(ids)
        standin.events.clear()
        metrics = engine.load_weights(perturbed.state_dict().items(), version=1)
        assert standin.events == ["pause_generation:retract", "update_weights_from_disk", "continue_generation"]
        assert metrics["sync/num_tensors"] == len(perturbed.state_dict())
        assert metrics["sync/bytes"] == sum(t.numel() * 4 for t in perturbed.state_dict().values())
        assert metrics["sync/seconds"] > 0
        assert engine.policy_version == 1
        after = engine.score(ids)
        assert max(abs(a - b) for a, b in zip(after, before, strict=True)) > 0.05
        assert after == pytest.approx(trainer_logprobs(perturbed, ids), abs=1e-5)
        [completion] = engine.generate([PROMPTS[0]], sampled((9,)))
        assert completion.versions == [1] * len(completion.token_ids)
        assert httpx.get(f"{standin.url}/get_model_info").json()["weight_version"] == "1"

        first_snapshot = Path(standin.model_path)
        engine.load_weights(perturbed.state_dict().items(), version=2)
        assert not first_snapshot.exists() and Path(standin.model_path).is_dir()  # only the newest is kept

        with pytest.raises(EngineError, match=r"did not load weights version 3.*Failed to update weights"):
            engine.load_weights([("no.such.weight", torch.zeros(2))], version=3)
        assert engine.policy_version == 2 and engine.score(ids) == pytest.approx(after, abs=1e-5)
        assert standin.events[-1] == "continue_generation"  # a refused sync does not leave generation paused
        last_snapshot = Path(standin.model_path)
    finally:
        engine.close()
        standin.reset()
    assert not last_snapshot.exists()  # close deletes the snapshots the engine wrote


def test_sleep_frees_the_weights_until_the_next_sync(
    standin: SglangStandin, tiny_model_path: Path, reference: HfEngine
) -> None:
    engine = connect(standin, tiny_model_path)
    ids = PROMPTS[0] + [5, 6]
    try:
        assert engine.sleep() == {"colocate/freed_bytes": 0.0}  # no CUDA here: nothing this process can see
        with pytest.raises(EngineError, match="while asleep"):
            engine.score(ids)
        with pytest.raises(EngineError, match="while asleep"):
            engine.load_weights(reference.model.state_dict().items(), version=1)
        engine.wake_up()
        with pytest.raises(EngineError, match="before load_weights"):
            engine.generate([PROMPTS[0]], sampled((1,)))
        engine.load_weights(reference.model.state_dict().items(), version=1)
        assert engine.score(ids) == pytest.approx(reference.score(ids), abs=1e-5)
        assert standin.events[-6:] == [
            "release_memory_occupation",
            "resume_memory_occupation",
            "pause_generation:retract",
            "update_weights_from_disk",
            "resume_memory_occupation",
            "continue_generation",
        ]
    finally:
        engine.close()
        standin.reset()
    standin.memory_saver = False
    try:
        engine = connect(standin, tiny_model_path)
        with pytest.raises(EngineError, match="--enable-memory-saver"):
            engine.sleep()
        engine.close()
    finally:
        standin.memory_saver = True


def test_the_standin_refuses_what_sglang_refuses(standin: SglangStandin) -> None:
    unknown = httpx.post(f"{standin.url}/generate", json={"input_ids": [1, 2], "sampling_params": {"max_tokens": 2}})
    assert unknown.status_code == 400 and unknown.json()["error"].startswith("unknown field `max_tokens`")
    mistyped = httpx.post(f"{standin.url}/generate", json={"input_ids": [1], "sampling_params": {"top_p": "x"}})
    assert mistyped.status_code == 400 and "expected f64" in mistyped.json()["error"]
    bad = httpx.post(f"{standin.url}/generate", json={"input_ids": [1], "sampling_params": {"top_p": 0.0}})
    assert bad.status_code == 400 and bad.json() == {"error": {"message": "top_p must be in (0, 1], got 0.0."}}
    missing = httpx.post(f"{standin.url}/update_weights_from_disk", json={"load_format": "auto"})
    assert missing.status_code == 422


# --- bad input ----------------------------------------------------------------------------------------------------


def test_nothing_listening(tiny_model_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(EngineError, match=f"sglang engine: {url} .*cannot connect"):
        SglangEngine(SglangEngineConfig(url=url), model_path=tiny_model_path, dtype="float32", seed=0)


class _OtherServer(http.server.BaseHTTPRequestHandler):
    """A server of another kind: 404 HTML everywhere, except a JSON /get_model_info of the wrong shape on port B."""

    json_info = False

    def do_GET(self) -> None:
        if self.json_info and self.path == "/get_model_info":
            body, status, kind = b'{"id": "some-model", "object": "model"}', 200, "application/json"
        else:
            body, status, kind = b"<html><body>Not Found</body></html>", 404, "text/html"
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.mark.parametrize("json_info", [False, True])
def test_a_server_of_another_kind(tiny_model_path: Path, json_info: bool) -> None:
    handler = type("Handler", (_OtherServer,), {"json_info": json_info})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    expected = "is not an SGLang server" if json_info else "does not answer as an SGLang server.*HTTP 404"
    try:
        with pytest.raises(EngineError, match=f"{url} {expected}"):
            SglangEngine(SglangEngineConfig(url=url), model_path=tiny_model_path, dtype="float32", seed=0)
    finally:
        server.shutdown()
        server.server_close()


def test_the_wrong_model(standin: SglangStandin, tiny_model_path: Path, tmp_path: Path) -> None:
    with pytest.raises(EngineError, match=r"serves .* not this run's model 'someone/other'"):
        connect(standin, tiny_model_path, served_model_name="someone/other")
    with pytest.raises(EngineError, match=f"not this run's model '{tmp_path}'"):
        connect(standin, tmp_path)
    connect(standin, tiny_model_path, served_model_name=str(tiny_model_path)).close()


def test_a_server_that_stops_answering_times_out(standin: SglangStandin, tiny_model_path: Path) -> None:
    engine = connect(standin, tiny_model_path, request_timeout_s=1.0)
    standin.hang()
    started = time.monotonic()
    try:
        with pytest.raises(EngineError, match="did not answer within 1 s"):
            engine.generate([PROMPTS[0]], sampled((1,)))
        assert time.monotonic() - started < 10
    finally:
        standin.answer()
        engine.close()


@pytest.mark.skipif(importlib.util.find_spec("sglang") is not None, reason="sglang is installed here")
def test_starting_a_server_without_sglang(tiny_model_path: Path) -> None:
    with pytest.raises(EngineError, match=r"needs the `sglang` package.*rollout\.engine\.url"):
        SglangEngine(SglangEngineConfig(), model_path=tiny_model_path, dtype="float32", seed=0)


def test_starting_a_server_on_a_port_in_use(tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sglang_module, "_sglang_installed", lambda: True)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(EngineError, match=f"port {port} on 127.0.0.1 is already in use"):
            SglangEngine(SglangEngineConfig(port=port), model_path=tiny_model_path, dtype="float32", seed=0)


def test_a_server_sharpen_starts_runs_until_close_and_comes_back_after_a_kill(
    tiny_model_path: Path, reference: HfEngine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The launch command (SGLang's flags) starts the stand-in as a program; its log goes to log_dir. Killed with
    SIGKILL, the server's requests fail as a replica failure (`EngineUnavailable`, which the router re-sends), and
    `restart` starts a new one on the same port, at version 0, giving the same tokens."""
    monkeypatch.setattr(sglang_module, "_sglang_installed", lambda: True)
    monkeypatch.setattr(SglangEngine, "launcher", (str(STANDIN),))
    config = SglangEngineConfig(start_timeout_s=120, enable_memory_saver=True, deterministic_inference=True)
    engine = SglangEngine(config, model_path=tiny_model_path, dtype="float32", seed=3, log_dir=tmp_path)
    try:
        assert engine.server is not None and engine.server.is_running
        [param] = sampled((4,))
        [completion] = engine.generate([PROMPTS[0]], [param])
        assert completion.token_ids == reference.generate([PROMPTS[0]], [param])[0].token_ids
        assert "SGLang stand-in" in engine.server.log_tail()
        assert list(tmp_path.glob("sglang-*.log"))
        killed, url = engine.server, engine.url
        os.killpg(killed.process.pid, signal.SIGKILL)
        killed.process.wait(10)
        with pytest.raises(EngineUnavailable, match=rf"cannot connect to {url}/generate"):
            engine.generate([PROMPTS[0]], [param])
        engine.policy_version = 3  # as after three syncs
        assert isinstance(engine, RestartableEngine)
        engine.restart()
        assert engine.server is not killed and engine.server.is_running and engine.url == url
        assert engine.policy_version == 0
        assert engine.generate([PROMPTS[0]], [param])[0].token_ids == completion.token_ids
    finally:
        engine.close()
    assert engine.server is not None and not engine.server.is_running


def test_an_engine_at_a_url_restarts_by_waiting_until_the_server_answers(
    standin: SglangStandin, tiny_model_path: Path
) -> None:
    engine = connect(standin, tiny_model_path)
    engine.policy_version = 2
    standin.hang()
    restarting = threading.Thread(target=engine.restart)
    try:
        restarting.start()
        time.sleep(0.5)
        assert restarting.is_alive()  # it waits for the server to answer again
    finally:
        standin.answer()
    restarting.join(timeout=30)
    try:
        assert not restarting.is_alive() and engine.policy_version == 0
        assert engine.generate([PROMPTS[0]], sampled((1,)))[0].token_ids
    finally:
        engine.close()


# --- a real SGLang server -----------------------------------------------------------------------------------------

BF16 = 0.15
"""Mean |logprob difference| per token allowed between two computations in bfloat16 (decode and prefill; SGLang
and transformers): a misaligned token costs several nats."""


@pytest.mark.gpu
def test_a_real_sglang_server(smollm2_path: Path, tmp_path: Path) -> None:
    """SHARPEN_SGLANG_URL: a running server of SmolLM2 (benchmarks/gpu_check.sh starts one); else one this test
    starts, where sglang and CUDA are available. Logprobs agree with the server's own scoring and, after a sync of
    changed weights, with transformers' on those weights (bfloat16 on the server: loose tolerances)."""
    from transformers import AutoModelForCausalLM

    url = os.environ.get("SHARPEN_SGLANG_URL")
    if url is None and (importlib.util.find_spec("sglang") is None or not torch.cuda.is_available()):
        pytest.skip("needs SHARPEN_SGLANG_URL, or sglang and a CUDA device")
    config = SglangEngineConfig(url=url, start_timeout_s=900, mem_fraction_static=0.3)
    engine = SglangEngine(
        config, model_path=smollm2_path, dtype="bfloat16", seed=0, request_timeout_s=300, log_dir=tmp_path
    )
    try:
        prompts = [[1, 504, 3458, 314, 253, 2330, 28], [1, 1978, 540, 2575, 30]]
        params = [SamplingParams(max_new_tokens=16, temperature=1.0, seed=seed) for seed in (1, 2)]
        completions = engine.generate(prompts, params)
        for prompt, completion in zip(prompts, completions, strict=True):
            assert 0 < len(completion.token_ids) <= 16 and completion.versions == [0] * len(completion.token_ids)
            scored = engine.score(prompt + completion.token_ids)[len(prompt) - 1 :]
            assert sum(abs(a - b) for a, b in zip(scored, completion.logprobs, strict=True)) / len(scored) < BF16

        model = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32)
        with torch.no_grad():
            model.model.norm.weight.mul_(2.0)  # sharper logits: every logprob moves
        ids = prompts[0] + completions[0].token_ids
        before = engine.score(ids)
        metrics = engine.load_weights(model.state_dict().items(), version=1)
        assert metrics["sync/num_tensors"] > 0 and engine.policy_version == 1
        after = engine.score(ids)
        expected = trainer_logprobs(model, ids)
        moved = sum(abs(a - b) for a, b in zip(after, before, strict=True)) / len(ids)
        error = sum(abs(a - b) for a, b in zip(after, expected, strict=True)) / len(ids)
        assert error < BF16 and moved > 5 * error
        [completion] = engine.generate([prompts[1]], [params[1]])
        assert completion.versions == [1] * len(completion.token_ids)
    finally:
        engine.close()
