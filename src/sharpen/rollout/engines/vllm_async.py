"""The async vLLM engine: vLLM's `AsyncLLM` in this process (its engine core in a child process), taking every
request on its own and batching them continuously (``rollout.engine.async_engine``).

Owns the AsyncLLM's life on the engine's own event loop (`EventLoopThread`: the AsyncLLM binds to the loop it is
created on, so it is created, called and shut down only there), one request per completion, and weight updates
into a running engine. Everything else is `VllmEngine`'s (`vllm.py`): the engine arguments, the CPU build's
environment, the sampling parameters, the mapping of vLLM's outputs to `Completion`, and the verified
shared-memory buckets of a weight sync, whose collective RPCs run here to completion on the loop.

A weight update pauses generation with vLLM's ``keep`` mode: requests in flight are frozen, not aborted nor
drained. The pause also clears the KV cache, which preempts them, so when generation resumes with the new weights
their context is recomputed and their next tokens are sampled from the new policy alone. vLLM labels every engine
step with a weight version, which sharpen sets to the policy version while paused; a finished request reports the
spans of tokens each label sampled (`vllm.outputs.WeightVersionSpan`), which become `Completion.versions`, so a
request that spans an update has tokens of both versions.

A sync that fails leaves the weights half loaded: the requests in flight are aborted (each raises `EngineError`),
generation stays paused, and the engine refuses requests until a sync succeeds.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sharpen.config.engines import VllmEngineConfig
from sharpen.rollout.engines.base import EngineError, EngineInputError, device_free_bytes
from sharpen.rollout.engines.server import RequestLevelEngine
from sharpen.rollout.engines.vllm import (
    RpcBucketTarget,
    VllmRequests,
    broadcast_metrics,
    check_broadcast,
    check_joined,
    check_sleep_mode,
    engine_arguments,
    prepare_cpu_environment,
    probe_logprobs,
    probe_params,
    vllm_completion,
    vllm_sampling_params,
)
from sharpen.rollout.engines.vllm_routes import routes_of
from sharpen.rollout.weight_sync.buckets import BucketError, engine_sync_dtype
from sharpen.rollout.weight_sync.streaming import BucketedSender
from sharpen.types import Completion, ImagePart, PolicyVersion, SamplingParams

if TYPE_CHECKING:
    import torch
    from vllm import RequestOutput
    from vllm import SamplingParams as VllmSamplingParams
    from vllm.outputs import CompletionOutput
    from vllm.v1.engine.async_llm import AsyncLLM

_NAME = "vLLM async engine"


class VllmAsyncEngine(RequestLevelEngine):
    """`InferenceEngine`, `AsyncEngine`, `WeightGroupEngine` and `SleepableEngine` on one in-process AsyncLLM."""

    name = "vllm-async"

    def __init__(
        self,
        config: VllmEngineConfig,
        *,
        model_path: Path,
        dtype: str,
        seed: int,
        bucket_bytes: int = 128 << 20,
        sleep_mode: bool = False,
        route_experts: int | None = None,
    ) -> None:
        """``route_experts``: the MoE's routed experts per layer, when each completion carries its routes (R3)."""
        prepare_cpu_environment(config.tensor_parallel_size)
        check_sleep_mode(sleep_mode)
        arguments = engine_arguments(
            config,
            model_path=model_path,
            dtype=dtype,
            seed=seed,
            sleep_mode=sleep_mode,
            return_routes=route_experts is not None,
        )
        self.route_experts = route_experts
        super().__init__()
        self.config = config
        started = time.perf_counter()
        made: list[AsyncLLM] = []
        try:
            self._loop.run(self._start(arguments, made))
        except BaseException:
            self._loop.close()
            raise
        self.llm = made.pop()
        self.requests = VllmRequests(model_path)
        self.startup_seconds = time.perf_counter() - started
        self.policy_version: PolicyVersion = 0
        self.is_asleep = False
        self._is_cache_asleep = False  # woken weights, KV cache still released
        self._waking = asyncio.Lock()
        self._refusal: str | None = None  # why requests are refused (a failed sync), until a sync succeeds
        self._request_ids = itertools.count()
        self.bucket_bytes = bucket_bytes
        self.dtype = dtype  # floating-point weights are synced in it (`engine_sync_dtype`)
        self.sender: BucketedSender | None = None  # its shared-memory slots are made on the first sync
        self._is_closed = False

    @staticmethod
    async def _start(arguments: dict[str, Any], made: list[AsyncLLM]) -> None:
        """Make the AsyncLLM inside a coroutine, so that its output handler runs on this loop, and hand it over in
        ``made``: this frame outlives the call (vLLM 0.32's start-up leaves it referenced from a frame of an import
        it makes), so none of its locals may hold the AsyncLLM, which must be collected at `close` (collected at
        interpreter exit instead, its finaliser fails)."""
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        made.append(AsyncLLM.from_engine_args(AsyncEngineArgs(**arguments, disable_log_stats=True)))
        await made[0].update_weight_version("0")  # the initial weights' label ("default" otherwise)

    # generation

    async def _ready(self, call: str) -> None:
        if self.is_asleep:
            raise EngineError(f"{_NAME}: {call}() while asleep (call wake_up() and load_weights() first)")
        if self._refusal is not None:
            raise EngineError(f"{_NAME}: {call}() refused: {self._refusal}; a successful weight sync must come first")
        if self._is_cache_asleep:
            async with self._waking:
                if self._is_cache_asleep:
                    await self.llm.wake_up(tags=["kv_cache"])
                    self._is_cache_asleep = False

    async def _request(
        self, prompt: list[int], params: VllmSamplingParams, images: Sequence[ImagePart] = ()
    ) -> RequestOutput:
        """One request's final output; any failure inside vLLM, and an aborted request, is an `EngineError`.
        ``images``: those the prompt holds placeholders for (a vision-language model's multimodal request)."""
        from vllm.exceptions import VLLMClientError
        from vllm.inputs import tokens_input

        request: Any = self.requests.request(prompt, images)  # refuses placeholders without their images
        if "multi_modal_data" not in request:
            request = tokens_input(prompt)  # plain token prompts skip vLLM's input processing
        request_id = f"sharpen-{next(self._request_ids)}"
        final: RequestOutput | None = None
        try:
            async for output in self.llm.generate(request, params, request_id):
                final = output
        except (VLLMClientError, ValueError) as error:  # vLLM's check of the request's own input (past max_model_len)
            raise EngineInputError(f"{_NAME}: request {request_id} refused: {_cause(error)}") from error
        except Exception as error:
            raise EngineError(f"{_NAME}: request {request_id} failed: {_cause(error)}") from error
        if final is None or not final.outputs:
            raise EngineError(f"{_NAME}: request {request_id} ended without an output")
        reason = final.outputs[0].finish_reason
        if reason in ("abort", "error"):
            why = f" ({self._refusal})" if self._refusal is not None else ""
            raise EngineError(f"{_NAME}: request {request_id} ended with finish reason {reason!r}{why}")
        if images:
            self.requests.check_expanded(final, prompt)
        return final

    async def generate_async_with_images(
        self, prompt: list[int], images: tuple[ImagePart, ...], params: SamplingParams
    ) -> Completion:
        """`generate_async` of a prompt that holds placeholders for ``images``."""
        return await self._loop.wrap(self._generate_one(prompt, params, images))

    def generate_with_images(
        self, prompts: list[list[int]], images: Sequence[tuple[ImagePart, ...]], params: list[SamplingParams]
    ) -> list[Completion]:
        """The batch `generate` of prompts with images (``images[i]``: prompt i's), run concurrently."""

        async def all_of() -> list[Completion]:
            requests = zip(prompts, params, images, strict=True)
            return list(await asyncio.gather(*(self._generate_one(p, q, i) for p, q, i in requests)))

        return self._loop.run(all_of())

    async def _generate_one(
        self, prompt: list[int], params: SamplingParams, images: tuple[ImagePart, ...] = ()
    ) -> Completion:
        from vllm.sampling_params import RequestOutputKind

        await self._ready("generate")
        options = vllm_sampling_params(params, output_kind=RequestOutputKind.FINAL_ONLY)
        output = await self._request(prompt, options, images)
        sample = output.outputs[0]
        versions = self._versions(sample, request_id=output.request_id)
        return vllm_completion(
            sample, versions=versions, decode=self.requests.text, routes_of=routes_of(prompt, self.route_experts)
        )

    def _versions(self, sample: CompletionOutput, *, request_id: str) -> list[PolicyVersion]:
        """The policy version of each token, from vLLM's weight-version spans (the version held now when vLLM
        reported no span)."""
        num_tokens = len(sample.token_ids)
        if sample.weight_versions is None:
            return [self.policy_version] * num_tokens
        versions: list[PolicyVersion] = []
        for span in sample.weight_versions:
            try:
                version = int(span.version)
            except ValueError:
                raise EngineError(
                    f"{_NAME}: request {request_id} has tokens of weight version {span.version!r}, which sharpen "
                    "did not set (only policy versions are)"
                ) from None
            versions.extend([version] * (span.end - span.start))
        if len(versions) != num_tokens:
            raise EngineError(
                f"{_NAME}: request {request_id}: weight versions of {len(versions)} of {num_tokens} tokens"
            )
        return versions

    def score(self, token_ids: list[int], images: tuple[ImagePart, ...] = ()) -> list[float]:
        """`InferenceEngine.score`; ``images``: those the ids hold placeholders for (an image prompt's probe)."""
        return self._loop.run(self._score(token_ids, images))

    async def _score(self, token_ids: list[int], images: tuple[ImagePart, ...] = ()) -> list[float]:
        from vllm.sampling_params import RequestOutputKind

        await self._ready("score")
        output = await self._request(token_ids, probe_params(output_kind=RequestOutputKind.FINAL_ONLY), images)
        return probe_logprobs(output, token_ids)

    # weights

    def _collective_rpc(self, method: str, args: tuple[Any, ...] = ()) -> list[Any]:
        return self._loop.run(self.llm.collective_rpc(method, args=args))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], *, version: PolicyVersion) -> dict[str, float]:
        """Stream the weights in verified buckets into every worker (as `VllmEngine` does) while generation is
        paused; requests in flight continue with them. Any refusal raises `EngineError`."""
        if self.is_asleep:
            raise EngineError(f"{_NAME}: load_weights() while asleep (call wake_up() first)")
        sender = self.sender = self.sender or BucketedSender(
            bucket_bytes=self.bucket_bytes, dtype=engine_sync_dtype(self.dtype)
        )

        def load() -> dict[str, float]:
            try:
                report = sender.send(weights, version=version, target=RpcBucketTarget(self._collective_rpc))
            except BucketError as error:
                raise EngineError(f"{_NAME} rejected weights version {version}: {error}") from error
            return report.metrics()

        return self._update(load, version=version)

    def _update(self, load: Callable[[], dict[str, float]], *, version: PolicyVersion) -> dict[str, float]:
        """Run ``load`` with generation paused (``keep``), then label the new weights and resume; after a failure,
        abort what is in flight and stay paused (the weights may mix two versions)."""
        started = time.perf_counter()
        self._loop.run(self.llm.pause_generation(mode="keep", clear_cache=True))
        try:
            metrics = load()
        except BaseException as error:
            self._loop.run(self._refuse(f"weights version {version} failed to load ({_cause(error)})"))
            raise
        self._loop.run(self._commit(version))
        return {**metrics, "sync/paused_seconds": time.perf_counter() - started}

    async def _commit(self, version: PolicyVersion) -> None:
        await self.llm.update_weight_version(str(version))  # labels the tokens sampled from now on
        if not self._is_cache_asleep:  # sleep already dropped the cache
            await self.llm.reset_prefix_cache()  # cached KV entries were computed with the old weights
        if self.requests.vision is not None:  # and so were cached image features (requests in flight recompute them)
            await self.llm.reset_encoder_cache()
        self.policy_version = version
        self._refusal = None
        await self.llm.resume_generation()

    async def _refuse(self, reason: str) -> None:
        self._refusal = reason
        await self.llm.pause_generation(mode="abort", clear_cache=True)

    @property
    def num_weight_group_members(self) -> int:
        return int(self.llm.vllm_config.parallel_config.world_size)

    def join_weight_group(
        self, *, master_addr: str, master_port: int, first_rank: int, world_size: int, backend: str
    ) -> None:
        """Every vLLM worker joins the weight group (`vllm_receiver.py`), so broadcasts land in the workers."""
        check_joined(
            self._collective_rpc(
                "sharpen_join_weight_group", args=(master_addr, master_port, first_rank, world_size, backend)
            )
        )

    def receive_broadcast(self, *, version: PolicyVersion) -> dict[str, float]:
        """Every worker takes the trainer's broadcast of version ``version`` straight into its model, with
        generation paused as for `load_weights`; a refusal raises `EngineError` once the sync has been drained."""
        if self.is_asleep:
            raise EngineError(f"{_NAME}: receive_broadcast() while asleep (call wake_up() first)")

        def receive() -> dict[str, float]:
            started = time.perf_counter()
            replies = self._collective_rpc("sharpen_receive_broadcast", args=(version,))
            check_broadcast(replies, version=version)
            return broadcast_metrics(replies, started=started)

        return self._update(receive, version=version)

    # memory

    def sleep(self) -> dict[str, float]:
        """Discard the weights and the KV cache (vLLM's sleep level 2; requests in flight are aborted)."""
        if self.is_asleep:
            return {"colocate/freed_bytes": 0.0}
        before = device_free_bytes()
        self._loop.run(self.llm.sleep(level=2))
        self.is_asleep = True
        self._is_cache_asleep = True
        return {"colocate/freed_bytes": float(max(device_free_bytes() - before, 0))}

    def wake_up(self) -> dict[str, float]:
        """Take back the weights' memory; the KV cache comes back on the next request."""
        if self.is_asleep:
            self._loop.run(self.llm.wake_up(tags=["weights"]))
            self.is_asleep = False
        return {}

    def close(self) -> None:
        if self._is_closed:
            return
        self._is_closed = True
        if self.sender is not None:
            self.sender.close()

        async def shutdown() -> None:
            self.llm.shutdown()
            if self.llm.output_handler is not None:  # let its cancellation finish before the loop stops
                await asyncio.gather(self.llm.output_handler, return_exceptions=True)

        try:
            self._loop.run(shutdown())
        finally:
            self._loop.close()
            del self.llm  # its finaliser shuts down again, which fails at interpreter exit


def _cause(error: BaseException) -> str:
    """The innermost message of ``error`` (vLLM's `EngineGenerateError` has none of its own)."""
    while not str(error) and error.__cause__ is not None:
        error = error.__cause__
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
