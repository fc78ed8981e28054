"""The `vllm_server` engine: vLLM behind its own HTTP server, started by sharpen or already running at a URL.

Speaks vLLM 0.32's routes (read from the installed package, `vllm/entrypoints`):

- generation: ``POST /inference/v1/generate`` (token ids in, token ids out; ``output_mode = "text"`` also returns
  the detokenised text and each sampled token's logprob), which exists when the server runs with
  ``--enable-scale-out``. Each episode's request is its own HTTP request, and the server batches all of them
  continuously. The server runs with ``--logprobs-mode processed_logprobs``, so logprobs are those after temperature,
  top-k and top-p (the truncated distribution's), as the in-process engine's. Every choice carries ``weight_versions``:
  spans of output tokens and the weight version label the server held while sampling them, which become the completion's
  per-token versions.
- the weight-sync probe: the same route with ``prompt_logprobs = 0``.
- weight syncs: the development routes (``VLLM_SERVER_DEV_MODE=1``). ``POST /pause?mode=keep`` freezes requests in
  flight, the verified buckets of `weight_sync/streaming.py` go to sharpen's worker extension
  (``--worker-extension-cls``) through ``POST /collective_rpc``, ``POST /reset_prefix_cache?reset_running_requests=
  true`` drops every KV entry the old weights computed (frozen requests recompute theirs), ``POST
  /update_weight_version`` labels the new weights with sharpen's version, and ``POST /resume`` lets the frozen
  requests go on: a request that spans a sync reports tokens of both versions. The buckets travel through shared
  memory, so the server must run on this host; a server elsewhere takes the Ray broadcast (`WeightGroupEngine`).
- checks on connecting: ``GET /version`` (a vLLM server), ``GET /v1/models`` (the right model), ``GET /is_paused``
  (the development routes are on), one token through the generate route (scale-out routes on) and one
  collective RPC (sharpen's worker extension loaded). Each failure is one `EngineError` that says what to change.

Started by sharpen (``url`` unset), the server is ``python -m vllm.entrypoints.openai.api_server`` with the recipe's
engine settings, the CPU environment of the in-process engine, and its output in ``log_dir``; `close` stops it. On
the CPU build it runs without chunked prefill (`cpu_scheduling_arguments` in `vllm.py`: with it, a seeded request
whose prefill is split kills the engine core).

`restart` (the router calls it on a failed replica, in the background) kills what is left of a server sharpen
started and starts the same command on the same port, or waits until a server at ``url`` answers again; either way
the connection checks run again and the engine reports version 0 until its next weight sync. A server whose workers
joined the broadcast weight group is not restarted: that group has a fixed size, and a new process cannot join it.
Starting, restarting and closing are `ServerEngine`'s (`server.py`), as for SGLang; this module gives the command
line and the checks on connecting.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from sharpen.config.engines import VllmServerEngineConfig
from sharpen.environments.tool_formats.decode import local_decoder
from sharpen.rollout.engines.base import EngineError, EngineUnavailable
from sharpen.rollout.engines.server import ServerEngine
from sharpen.rollout.engines.vllm import (
    WORKER_EXTENSION,
    RpcBucketTarget,
    broadcast_metrics,
    check_broadcast,
    check_joined,
    cpu_scheduling_arguments,
    prepare_cpu_environment,
)
from sharpen.rollout.engines.vllm_routes import decode_routed, vllm_routes
from sharpen.rollout.weight_sync.buckets import BucketError, engine_sync_dtype
from sharpen.rollout.weight_sync.streaming import BucketedSender
from sharpen.types import Completion, ExpertRoutes, PolicyVersion, SamplingParams

if TYPE_CHECKING:
    import torch

_GENERATE = "/inference/v1/generate"


class VllmServerEngine(ServerEngine[VllmServerEngineConfig]):
    name = "vllm_server engine"
    log_name = "vllm-server"
    server_env: ClassVar[Mapping[str, str]] = {"VLLM_SERVER_DEV_MODE": "1"}  # pause, collective_rpc, weight versions

    def __init__(
        self,
        config: VllmServerEngineConfig,
        *,
        model_path: Path,
        dtype: str,
        seed: int,
        bucket_bytes: int = 128 << 20,
        request_timeout_s: float | None = None,
        log_dir: Path | None = None,
        route_experts: int | None = None,
    ) -> None:
        """``route_experts``: the MoE's routed experts per layer, when each completion carries its routes (R3: a
        server sharpen starts gets ``--enable-return-routed-experts``; a server at a URL must have it)."""
        super().__init__(config)
        self.route_experts = route_experts
        self.bucket_bytes = bucket_bytes
        self.dtype = dtype  # floating-point weights are synced in it (`engine_sync_dtype`)
        self.sender: BucketedSender | None = None
        self._refusal: str | None = None  # set while a failed sync leaves half-loaded weights behind
        self._in_weight_group = False
        self.served_model = config.served_model_name or str(model_path)
        self.decode = local_decoder(model_path)
        """The completion's text from its ids keeping the tool-call markers (the server's text has no special
        token); None without the model's folder here."""
        self._open(model_path=model_path, dtype=dtype, seed=seed, request_timeout_s=request_timeout_s, log_dir=log_dir)

    def _server_command(self, *, port: int, model_path: Path, dtype: str, seed: int) -> list[str]:
        config = self.config
        prepare_cpu_environment(config.tensor_parallel_size)
        return [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(model_path),
            "--served-model-name",
            self.served_model,
            "--host",
            config.host,
            "--port",
            str(port),
            "--dtype",
            dtype,
            "--seed",
            str(seed),
            "--max-model-len",
            str(config.max_model_len),
            "--gpu-memory-utilization",
            str(config.gpu_memory_utilization),
            "--tensor-parallel-size",
            str(config.tensor_parallel_size),
            "--logprobs-mode",
            "processed_logprobs",
            "--worker-extension-cls",
            WORKER_EXTENSION,
            "--enable-scale-out",
            *(["--enable-return-routed-experts"] if self.route_experts is not None else []),
            *(["--enforce-eager"] if config.enforce_eager else []),
            *_cpu_scheduling_flags(config.max_model_len),
            *config.extra_args,
        ]

    def restart(self) -> None:
        """As `ServerEngine.restart`, unless the server's workers joined the broadcast weight group."""
        if self._in_weight_group:
            raise EngineError(
                f"{self.name} at {self.url} cannot be restarted: its workers joined the broadcast weight group, "
                "whose fixed size a new server cannot rejoin (weight_sync.transport = 'broadcast')"
            )
        super().restart()

    def _forget_server_state(self) -> None:
        self._refusal = None

    def _connect(self) -> None:
        self._loop.run(self._check_server())

    async def _check_server(self) -> None:
        where = f"{self.name}: {self.url}"
        try:
            version = (await self.client.get("/version")).get("version")
        except (EngineError, AttributeError) as error:
            raise EngineError(f"{where} is not a vLLM server (GET /version: {error})") from None
        models = await self.client.get("/v1/models")
        names = [entry.get("id") for entry in models.get("data", [])] if isinstance(models, dict) else []
        if self.served_model not in names:
            raise EngineError(
                f"{where} (vLLM {version}) serves {names}, not the run's model {self.served_model!r}: start it on "
                "the recipe's model, or set rollout.engine.served_model_name to the name it serves"
            )
        try:
            await self.client.get("/is_paused")
        except EngineError:
            raise EngineError(
                f"{where} (vLLM {version}) has no development routes (pause, collective_rpc), which weight syncs "
                "need: start it with VLLM_SERVER_DEV_MODE=1 in its environment"
            ) from None
        await self._label_weights(self.policy_version)
        try:
            await self._generate_one([0], SamplingParams(max_new_tokens=1, temperature=0.0))
        except EngineError as error:
            raise EngineError(
                f"{where} (vLLM {version}) cannot generate from token ids ({error}): start it with "
                "--enable-scale-out (and --logprobs-mode processed_logprobs)"
            ) from None
        try:
            await self._rpc("sharpen_abort_sync", "connect-check")
        except EngineError as error:
            raise EngineError(
                f"{where} (vLLM {version}) did not run sharpen's weight receiver ({error}): start it with "
                f"--worker-extension-cls {WORKER_EXTENSION}"
            ) from None

    # generation

    def _body(self, prompt: list[int], params: SamplingParams) -> dict[str, Any]:
        sampling: dict[str, Any] = {
            "max_tokens": params.max_new_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "top_k": params.top_k or -1,
            "logprobs": 0,
            "stop_token_ids": list(params.stop_token_ids),
        }
        if params.seed is not None:
            sampling["seed"] = params.seed
        return {"token_ids": prompt, "model": self.served_model, "output_mode": "text", "sampling_params": sampling}

    async def _generate_one(self, prompt: list[int], params: SamplingParams) -> Completion:
        self._check_whole()
        server = self.server
        if server is not None and not server.is_running:
            raise EngineUnavailable(
                f"{self.name} at {self.url}: the server exited with code {server.process.returncode} "
                f"(log: {server.log_path})"
            )
        reply = await self.client.post(_GENERATE, self._body(prompt, params))
        try:
            (choice,) = reply["choices"]
            ids = [int(token) for token in choice["token_ids"]]
            logprobs = [float(entry["logprob"]) for entry in (choice.get("logprobs") or {}).get("content") or []]
            reason = choice.get("finish_reason")
            spans = choice.get("weight_versions")
            routed = choice.get("routed_experts")
        except (KeyError, TypeError, ValueError) as error:
            raise EngineError(
                f"{self.name} at {self.url}: unexpected generate reply ({error!r}): {reply!r:.300}"
            ) from None
        if reason == "abort":
            raise EngineError(f"{self.name} at {self.url}: the server aborted a request (was it paused with abort?)")
        if len(logprobs) != len(ids):
            raise EngineError(f"{self.name} at {self.url}: {len(logprobs)} logprobs for {len(ids)} tokens")
        return Completion(
            token_ids=ids,
            logprobs=logprobs,
            text=str(choice.get("text") or "") if self.decode is None else self.decode(ids),
            finish_reason="length" if reason == "length" else "stop",
            versions=self._versions(spans, len(ids)),
            routes=None if self.route_experts is None else self._routes(routed, prompt, ids),
        )

    def _routes(self, routed: Any, prompt: list[int], ids: list[int]) -> ExpertRoutes:
        """The completion's routes from the reply's ``routed_experts`` (base64 of a ``.npy``, `decode_routed`)."""
        assert self.route_experts is not None
        try:
            rows = None if routed is None else decode_routed(str(routed))
        except ValueError as error:
            raise EngineError(f"{self.name} at {self.url}: unreadable routed_experts ({error})") from None
        try:
            return vllm_routes(rows, num_tokens=len(prompt) + len(ids), num_experts=self.route_experts)
        except EngineError as error:
            raise EngineError(
                f"{self.name} at {self.url}: {error} (start it with --enable-return-routed-experts)"
            ) from None

    def _versions(self, spans: Any, num_tokens: int) -> list[PolicyVersion]:
        """Per-token versions from the server's weight-version spans (the labels sharpen set)."""
        if not spans:
            return [self.policy_version] * num_tokens
        versions: list[PolicyVersion] = []
        for span in spans:
            label, start, end = span.get("version"), int(span["start"]), int(span["end"])
            if start != len(versions) or not str(label).lstrip("-").isdigit():
                raise EngineError(
                    f"{self.name} at {self.url}: weight version spans {spans} are not sharpen's (was the server's "
                    "weight version changed by someone else?)"
                )
            versions.extend([int(str(label))] * (end - start))
        if len(versions) != num_tokens:
            raise EngineError(f"{self.name} at {self.url}: weight version spans {spans} for {num_tokens} tokens")
        return versions

    def score(self, token_ids: list[int]) -> list[float]:
        self._check_whole()
        body = {
            "token_ids": token_ids,
            "model": self.served_model,
            "sampling_params": {"max_tokens": 1, "temperature": 1.0, "prompt_logprobs": 0},
        }
        reply = self._loop.run(self.client.post(_GENERATE, body))
        try:
            positions = reply["prompt_logprobs"][1:]
            return [float(step[str(token)]["logprob"]) for step, token in zip(positions, token_ids[1:], strict=True)]
        except (KeyError, TypeError, ValueError) as error:
            raise EngineError(f"{self.name} at {self.url}: no prompt logprobs for the probe ({error!r})") from None

    # weights

    async def _rpc(self, method: str, *args: Any) -> list[dict[str, Any]]:
        reply = await self.client.post("/collective_rpc", {"method": method, "args": list(args)})
        results = reply.get("results") if isinstance(reply, dict) else None
        if not isinstance(results, list) or not all(isinstance(result, dict) for result in results):
            raise EngineError(f"{self.name} at {self.url}: collective_rpc {method} replied {reply!r:.300}")
        return results

    def _collective_rpc(self, method: str, *, args: tuple[Any, ...] = ()) -> list[dict[str, Any]]:
        return self._loop.run(self._rpc(method, *args))

    async def _label_weights(self, version: PolicyVersion) -> None:
        await self.client.post("/update_weight_version", {"new_version": str(version)})

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], *, version: PolicyVersion) -> dict[str, float]:
        """Requests in flight are frozen, the weights stream in verified buckets into every worker, and the frozen
        requests go on with the new weights (their KV recomputed). A refusal raises `EngineError` and leaves the
        server paused: half-loaded weights must not generate."""
        if self.sender is None:
            self.sender = BucketedSender(bucket_bytes=self.bucket_bytes, dtype=engine_sync_dtype(self.dtype))
        started = time.perf_counter()
        self._loop.run(self.client.post("/pause", params={"mode": "keep"}))
        try:
            report = self.sender.send(weights, version=version, target=RpcBucketTarget(self._collective_rpc))
        except BucketError as error:
            self._refusal = f"weights version {version} failed to load ({error})"
            raise EngineError(f"{self.name} at {self.url} rejected weights version {version}: {error}") from error
        self._after_load(version)
        return {**report.metrics(), "sync/seconds": time.perf_counter() - started}

    def _after_load(self, version: PolicyVersion) -> None:
        async def resume() -> None:
            reset = await self.client.post("/reset_prefix_cache", params={"reset_running_requests": "true"})
            if not (isinstance(reset, dict) and reset.get("success")):
                raise EngineError(f"{self.name} at {self.url}: the prefix cache was not reset after a sync ({reset})")
            await self._label_weights(version)
            await self.client.post("/resume")

        self._loop.run(resume())
        self.policy_version = version
        self._refusal = None

    def _check_whole(self) -> None:
        if self._refusal is not None:
            raise EngineError(
                f"{self.name} at {self.url} refuses requests: {self._refusal}; it stays paused until a sync succeeds"
            )

    @property
    def num_weight_group_members(self) -> int:
        reply = self._loop.run(self.client.get("/get_world_size", params={"include_dp": "false"}))
        return int(reply["world_size"])

    def join_weight_group(
        self, *, master_addr: str, master_port: int, first_rank: int, world_size: int, backend: str
    ) -> None:
        """Every server worker joins the weight group (`vllm_receiver.py`), so broadcasts land in the workers."""
        args = (master_addr, master_port, first_rank, world_size, backend)
        self._in_weight_group = True
        check_joined(self._loop.run(self._rpc("sharpen_join_weight_group", *args), timeout=None))

    def receive_broadcast(self, *, version: PolicyVersion) -> dict[str, float]:
        started = time.perf_counter()
        self._loop.run(self.client.post("/pause", params={"mode": "keep"}))
        replies = self._loop.run(self._rpc("sharpen_receive_broadcast", version))
        try:
            check_broadcast(replies, version=version)
        except EngineError as error:
            self._refusal = f"weights version {version} failed to load ({error})"
            raise
        self._after_load(version)
        return broadcast_metrics(replies, started=started)

    def close(self) -> None:
        try:
            super().close()
        finally:
            if self.sender is not None:
                self.sender.close()
                self.sender = None


def _cpu_scheduling_flags(max_model_len: int) -> list[str]:
    arguments = cpu_scheduling_arguments(max_model_len, default_step_tokens=2048)
    if not arguments:
        return []
    return ["--no-enable-chunked-prefill", "--max-num-batched-tokens", str(arguments["max_num_batched_tokens"])]
