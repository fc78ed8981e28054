"""The vLLM engine: an in-process `vllm.LLM` (its engine core runs in a child process), on the CPU build here and
the same code on a GPU.

Prompts go in as token ids and the sampled tokens' logprobs come back in vLLM's ``processed_logprobs`` mode (after
temperature, top-k and top-p: the truncated, renormalised distribution the token was drawn from), which is the behaviour
policy the trainer's ratio needs (the trainer applies the same cut, `trainer/algorithms/sampling_mask`). Weights arrive
in shared-memory buckets (`rollout/weight_sync/streaming.py`), loaded by the worker extension in
`rollout/weight_sync/vllm_receiver.py`.

With ``sleep_mode`` (``runtime.colocate``) the engine uses vLLM's sleep mode: `sleep` discards the weights and
the KV cache (level 2: the weight sync after the step replaces the weights anyway), `wake_up` takes back only the
weights' memory, so the weights load before the KV cache is reallocated, which happens on the next generate or
score. vLLM offers sleep mode on CUDA, ROCm and XPU only, not on its CPU build.

A vision-language model's prompts with images (`generate_with_images`) go to vLLM as its multimodal requests: the
ids with each image's placeholder block folded back to the one placeholder vLLM expands itself (`VllmRequests`), and
the images. vLLM's expansion must give back exactly the ids sharpen rendered, or the request is an `EngineError`.

With ``route_experts`` (R3: ``trainer.moe.routing_replay = "r3"``) the engine starts with vLLM's
``enable_return_routed_experts``, and each completion carries the experts every prompt and generated token went to
(`vllm_routes`). vLLM's CPU build cannot (docs/moe.md); this path is written against vLLM 0.32's
``CompletionOutput.routed_experts`` and tested here on that type, not on a running engine.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from sharpen.config.engines import VllmEngineConfig
from sharpen.config.schema import LoraConfig
from sharpen.data.vision import (
    VisionProcessor,
    is_vision_model,
    load_image,
    placeholders_without_images,
    text_only_error,
)
from sharpen.environments.tool_formats.decode import completion_text
from sharpen.rollout.engines.base import EngineError, EngineInputError, device_free_bytes
from sharpen.rollout.engines.vllm_routes import RoutesOf, routes_of
from sharpen.rollout.weight_sync.buckets import BucketError, BucketManifest, engine_sync_dtype
from sharpen.rollout.weight_sync.streaming import BucketedSender
from sharpen.types import Completion, ImagePart, PolicyVersion, SamplingParams

if TYPE_CHECKING:
    import torch
    from vllm import RequestOutput
    from vllm import SamplingParams as VllmSamplingParams
    from vllm.logprobs import LogprobsOnePosition
    from vllm.lora.request import LoRARequest
    from vllm.outputs import CompletionOutput

    from sharpen.rollout.weight_sync.adapter import AdapterFolders

WORKER_EXTENSION = "sharpen.rollout.weight_sync.vllm_receiver.VllmWeightReceiver"


_BIND = "VLLM_CPU_OMP_THREADS_BIND"
_bound_by_us: str | None = None
"""The value this module gave VLLM_CPU_OMP_THREADS_BIND (a value a user set is never replaced)."""


def prepare_cpu_environment(tensor_parallel_size: int = 1) -> None:
    """Settings vLLM's CPU build needs (the cores its workers bind to, a 2 GiB KV cache); a user's own values win.
    vLLM's CPU workers each bind their OpenMP threads to a set of cores, one set per tensor-parallel rank ("0-1" for
    one rank, "0|1" for two)."""
    global _bound_by_us
    import torch

    if torch.cuda.is_available():
        return
    num_cores = max(os.cpu_count() or 1, 1)
    if tensor_parallel_size > num_cores:
        raise EngineError(
            f"vLLM's CPU build binds each tensor-parallel rank to cores of its own: {num_cores} cores cannot hold "
            f"tensor_parallel_size = {tensor_parallel_size}"
        )
    given = os.environ.get(_BIND)
    if given in (None, _bound_by_us):
        per_rank = num_cores // tensor_parallel_size
        sets = [(rank * per_rank, (rank + 1) * per_rank - 1) for rank in range(tensor_parallel_size)]
        _bound_by_us = "|".join(f"{first}-{last}" if last > first else str(first) for first, last in sets)
        os.environ[_BIND] = _bound_by_us
    elif given not in ("auto", "nobind") and len(given.split("|")) != tensor_parallel_size:
        raise EngineError(
            f"{_BIND} = {given!r} binds {len(given.split('|'))} vLLM worker(s), but tensor_parallel_size = "
            f"{tensor_parallel_size}: give one core set per worker, separated by '|' (e.g. '0|1'), or unset it"
        )
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")


def cpu_scheduling_arguments(max_model_len: int, *, default_step_tokens: int) -> dict[str, Any]:
    """On vLLM's CPU build: no chunked prefill, and a step's token budget that holds the longest prompt. With chunked
    prefill, a seeded request whose prefill is split over two steps kills the engine core: vLLM 0.32 rewinds the
    request's generator for the token it discards, which CPU generators cannot do ("CPU Generator does not use
    offset"). A step takes 4096 prompt tokens by default (2048 in the server), so a few dozen episodes waiting
    together were enough (tests/integration/test_vllm_server.py reproduces it). Nothing changes on GPUs."""
    import torch

    if torch.cuda.is_available():
        return {}
    return {"enable_chunked_prefill": False, "max_num_batched_tokens": max(default_step_tokens, max_model_len)}


def check_sleep_mode(sleep_mode: bool) -> None:
    from vllm.platforms import current_platform

    if sleep_mode and not current_platform.is_sleep_mode_available():
        raise EngineError(
            f"runtime.colocate needs vLLM's sleep mode, which vLLM does not offer on this platform "
            f"({current_platform.device_type or 'cpu'}; it needs CUDA, ROCm or XPU)"
        )


def engine_arguments(
    config: VllmEngineConfig,
    *,
    model_path: Path,
    dtype: str,
    seed: int,
    sleep_mode: bool,
    lora: LoraConfig | None = None,
    return_routes: bool = False,
    lm_head_float32: bool = False,
) -> dict[str, Any]:
    """The engine arguments sharpen gives vLLM (`vllm.LLM` and vLLM's async engine take the same); on the CPU build
    also `cpu_scheduling_arguments`; with ``lora`` (adapter-only sync) LoRA serving for one adapter of its rank;
    with ``return_routes`` an MoE's routed experts with every completion; with ``lm_head_float32`` the LM head in
    float32 (vLLM's ``head_dtype`` override: on the CPU it upcasts the head's weight and the hidden states and runs
    the projection in float32)."""
    lora_arguments: dict[str, Any] = {}
    if lora is not None:
        from sharpen.rollout.weight_sync.adapter import vllm_max_lora_rank

        try:
            lora_arguments = {"enable_lora": True, "max_lora_rank": vllm_max_lora_rank(lora.rank), "max_loras": 1}
        except BucketError as error:
            raise EngineError(str(error)) from error
    return {
        **lora_arguments,
        **cpu_scheduling_arguments(config.max_model_len, default_step_tokens=4096),
        "model": str(model_path),
        "dtype": dtype,  # validated by the config schema
        "seed": seed,
        "max_model_len": config.max_model_len,
        "enforce_eager": config.enforce_eager,
        "gpu_memory_utilization": config.gpu_memory_utilization,
        "logprobs_mode": "processed_logprobs",
        "worker_extension_cls": WORKER_EXTENSION,
        "enable_sleep_mode": sleep_mode,
        "tensor_parallel_size": config.tensor_parallel_size,
        **({"enable_return_routed_experts": True} if return_routes else {}),
        **({"hf_overrides": {"head_dtype": "float32"}} if lm_head_float32 else {}),
    }


def vllm_sampling_params(params: SamplingParams, **options: Any) -> VllmSamplingParams:
    """vLLM's sampling parameters for one completion with the sampled tokens' logprobs; ``options`` adds more."""
    from vllm import SamplingParams as VllmSamplingParams

    return VllmSamplingParams(
        n=1,
        max_tokens=params.max_new_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k or -1,  # vLLM's "off" is -1 (0 is accepted too)
        seed=params.seed,
        logprobs=0,
        stop_token_ids=list(params.stop_token_ids),
        **options,
    )


def probe_params(**options: Any) -> VllmSamplingParams:
    """Sampling parameters of the probe (`score`): the prompt's logprobs at temperature 1."""
    from vllm import SamplingParams as VllmSamplingParams

    return VllmSamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0, **options)


def vllm_completion(
    sample: CompletionOutput,
    versions: list[PolicyVersion] | None = None,
    *,
    decode: Callable[[list[int]], str] | None = None,
    routes_of: RoutesOf | None = None,
) -> Completion:
    """``decode``: the text from the ids (the engines pass `VllmRequests.text`, `completion_text`; None, for tests
    that read no text: vLLM's own, which skips every special token); ``routes_of``: with R3, the prompt's length and
    the model's expert count (`vllm_routes`)."""
    ids = list(sample.token_ids)
    if sample.logprobs is None or len(sample.logprobs) != len(ids):
        raise EngineError(f"vLLM returned {len(sample.logprobs or [])} logprobs for {len(ids)} tokens")
    # every sampled position has its logprobs (FlatLogprobs is typed as a sequence of optional positions)
    steps = cast("Sequence[LogprobsOnePosition]", sample.logprobs)
    return Completion(
        token_ids=ids,
        logprobs=[step[token].logprob for step, token in zip(steps, ids, strict=True)],
        text=sample.text if decode is None else decode(ids),
        finish_reason="length" if sample.finish_reason == "length" else "stop",
        versions=versions,
        routes=None if routes_of is None else routes_of.routes(sample.routed_experts, len(ids)),
    )


def probe_logprobs(output: RequestOutput, token_ids: list[int]) -> list[float]:
    prompt_logprobs = output.prompt_logprobs
    if prompt_logprobs is None:
        raise EngineError("vLLM returned no prompt logprobs for the probe")
    # only the first prompt position has no logprobs
    steps = cast("Sequence[LogprobsOnePosition]", prompt_logprobs[1:])
    return [step[token].logprob for step, token in zip(steps, token_ids[1:], strict=True)]


def why_vllm_cannot_load(model_path: Path) -> str | None:
    """None when the installed vLLM imports its module for the model folder's architecture, else what stops it (the
    architecture, the folder and the reason: vLLM's CPU build here lacks torchvision, which e.g. its Qwen2-VL module
    imports)."""
    import json

    from vllm.model_executor.models.registry import ModelRegistry

    architectures = json.loads((Path(model_path) / "config.json").read_text()).get("architectures") or ["(none)"]
    registered = ModelRegistry.models.get(architectures[0])
    if registered is None:
        return f"{architectures[0]} ({model_path}): vLLM does not know this architecture"
    try:
        registered.load_model_cls()
    except Exception as error:  # an import error deep in vLLM's model module, e.g. a missing torchvision
        return (
            f"{architectures[0]} ({model_path}): vLLM's module for it fails to import: {type(error).__name__}: {error}"
        )
    return None


class VllmRequests:
    """vLLM requests of a model's prompts: token ids alone, or, for a vision-language model's prompts with images,
    the ids compacted (`VisionProcessor.compact`) plus the images as vLLM's ``multi_modal_data``."""

    def __init__(self, model_path: Path) -> None:
        self.model_path = Path(model_path)
        self.vision = VisionProcessor.from_pretrained(model_path) if is_vision_model(model_path) else None
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_path)

    def text(self, ids: list[int]) -> str:
        """A completion's text, decoded as every engine decodes it (`completion_text`)."""
        return completion_text(self.tokenizer, ids)

    def request(self, ids: list[int], images: Sequence[ImagePart] = ()) -> dict[str, Any]:
        """The request of one prompt; placeholders without their images, or images for a text-only model, are a
        `ValueError` (as in the `hf` engine)."""
        if self.vision is None:
            if images:
                raise text_only_error("vLLM engine", len(images), str(self.model_path))
            return {"prompt_token_ids": ids}
        if not images:
            if self.vision.image_token_id in ids:
                raise placeholders_without_images(ids.count(self.vision.image_token_id))
            return {"prompt_token_ids": ids}
        loaded = [load_image(image, index) for index, image in enumerate(images)]
        return {"prompt_token_ids": self.vision.compact(ids, images), "multi_modal_data": {"image": loaded}}

    @staticmethod
    def check_expanded(output: RequestOutput, ids: list[int]) -> None:
        """vLLM's prompt after its own placeholder expansion must be the ids sharpen rendered (the trainer's)."""
        if output.prompt_token_ids is not None and list(output.prompt_token_ids) != ids:
            raise EngineError(
                f"vLLM expanded the image placeholders to {len(output.prompt_token_ids)} prompt tokens where sharpen's "
                f"processor rendered {len(ids)}: the model folder's processor and chat template disagree"
            )


def check_joined(replies: list[dict[str, Any]]) -> None:
    for worker, reply in enumerate(replies):
        if not reply.get("ok"):
            raise EngineError(f"vLLM worker {worker} could not join the weight group: {reply.get('error')}")


def check_broadcast(replies: list[dict[str, Any]], *, version: PolicyVersion) -> None:
    for worker, reply in enumerate(replies):
        if not reply.get("ok"):
            raise EngineError(f"vLLM worker {worker} rejected weights version {version}: {reply.get('error')}")


def broadcast_metrics(replies: list[dict[str, Any]], *, started: float) -> dict[str, float]:
    slowest = max(replies, key=lambda reply: reply.get("load_seconds", 0.0))
    return {
        "sync/seconds": time.perf_counter() - started,
        "sync/load_seconds": float(slowest.get("load_seconds", 0.0)),
        "sync/num_tensors": float(slowest.get("num_tensors", 0)),
        "sync/num_workers": float(len(replies)),
    }


class VllmEngine:
    def __init__(
        self,
        config: VllmEngineConfig,
        *,
        model_path: Path,
        dtype: str,
        seed: int,
        bucket_bytes: int = 128 << 20,
        sleep_mode: bool = False,
        lora: LoraConfig | None = None,
        route_experts: int | None = None,
        lm_head_float32: bool = False,
    ) -> None:
        """``lora``: the run's adapters when it syncs them alone (``trainer.lora.sync = "adapter"``): the engine then
        serves the base model's weights from ``model_path`` plus the adapter of the last `load_weights`;
        ``route_experts``: the MoE's routed experts per layer, when each completion carries its routes (R3)."""
        prepare_cpu_environment(config.tensor_parallel_size)
        from vllm import LLM

        check_sleep_mode(sleep_mode)
        if lora is not None and sleep_mode:
            raise EngineError("vLLM engine: an adapter-only LoRA sync cannot refill an engine woken from sleep")
        self.config = config
        started = time.perf_counter()
        self.route_experts = route_experts
        arguments = engine_arguments(
            config,
            model_path=model_path,
            dtype=dtype,
            seed=seed,
            sleep_mode=sleep_mode,
            lora=lora,
            return_routes=route_experts is not None,
            lm_head_float32=lm_head_float32,
        )
        self.llm = LLM(**arguments)
        self.requests = VllmRequests(model_path)
        self.startup_seconds = time.perf_counter() - started
        self.policy_version: PolicyVersion = 0
        self.is_asleep = False
        self._is_cache_asleep = False  # woken weights, KV cache still released
        self.bucket_bytes = bucket_bytes
        self.dtype = dtype  # floating-point weights are synced in it (`engine_sync_dtype`)
        self.sender: BucketedSender | None = None  # its shared-memory slots are made on the first sync
        self.adapters: AdapterFolders | None = None
        if lora is not None:
            from sharpen.rollout.weight_sync.adapter import AdapterFolders

            self.adapters = AdapterFolders(lora)
        self.lora_request: LoRARequest | None = None  # the adapter every request runs with (None: the base model)

    def sleep(self) -> dict[str, float]:
        if self.is_asleep:
            return {"colocate/freed_bytes": 0.0}
        before = device_free_bytes()
        self.llm.sleep(level=2)
        self.is_asleep = True
        self._is_cache_asleep = True
        return {"colocate/freed_bytes": float(max(device_free_bytes() - before, 0))}

    def wake_up(self) -> dict[str, float]:
        if self.is_asleep:
            self.llm.wake_up(tags=["weights"])
            self.is_asleep = False
        return {}

    def _check_awake(self, call: str) -> None:
        if self.is_asleep:
            raise EngineError(f"vLLM engine: {call}() while asleep (call wake_up() and load_weights() first)")
        if self._is_cache_asleep:
            self.llm.wake_up(tags=["kv_cache"])
            self._is_cache_asleep = False

    def generate(self, prompts: list[list[int]], params: list[SamplingParams]) -> list[Completion]:
        return self.generate_with_images(prompts, [()] * len(prompts), params)

    def generate_with_images(
        self, prompts: list[list[int]], images: Sequence[tuple[ImagePart, ...]], params: list[SamplingParams]
    ) -> list[Completion]:
        """`generate` for prompts that hold image placeholders (`VisionProcessor.render_prompt`): ``images[i]`` are
        prompt i's images, in order (empty for a text prompt)."""
        from vllm.exceptions import VLLMClientError

        self._check_awake("generate")
        requests: Any = [self.requests.request(ids, row) for ids, row in zip(prompts, images, strict=True)]
        try:  # vLLM checks every request before it runs any (and drops those added when one fails)
            outputs = self.llm.generate(
                requests, [vllm_sampling_params(p) for p in params], use_tqdm=False, lora_request=self.lora_request
            )
        except VLLMClientError as error:  # a request's own input: a prompt past max_model_len
            raise EngineInputError(f"vLLM engine: a request refused: {error}") from error
        for output, ids, row in zip(outputs, prompts, images, strict=True):
            if row:
                self.requests.check_expanded(output, ids)
        return [
            vllm_completion(output.outputs[0], decode=self.requests.text, routes_of=routes_of(ids, self.route_experts))
            for output, ids in zip(outputs, prompts, strict=True)
        ]

    def score(self, token_ids: list[int], images: tuple[ImagePart, ...] = ()) -> list[float]:
        """`InferenceEngine.score`; ``images``: those the ids hold placeholders for (an image prompt's probe)."""
        self._check_awake("score")
        request: Any = self.requests.request(token_ids, images)
        (output,) = self.llm.generate([request], probe_params(), use_tqdm=False, lora_request=self.lora_request)
        if images:
            self.requests.check_expanded(output, token_ids)
        return probe_logprobs(output, token_ids)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], *, version: PolicyVersion) -> dict[str, float]:
        """Stream the weights in buckets through shared memory into every worker; each verifies every bucket and
        reports the version and checksum it loaded, and any refusal raises `EngineError`. With adapter-only LoRA
        sync the weights are the adapter tensors alone (`load_adapter`)."""
        if self.is_asleep:
            raise EngineError("vLLM engine: load_weights() while asleep (call wake_up() first)")
        if self.adapters is not None:
            return self.load_adapter(weights, version=version)
        if self.sender is None:
            self.sender = BucketedSender(bucket_bytes=self.bucket_bytes, dtype=engine_sync_dtype(self.dtype))
        try:
            report = self.sender.send(weights, version=version, target=RpcBucketTarget(self.llm.collective_rpc))
        except BucketError as error:
            raise EngineError(f"vLLM rejected weights version {version}: {error}") from error
        self._drop_cached_results()
        self.policy_version = version
        return report.metrics()

    def load_adapter(self, weights: Iterable[tuple[str, torch.Tensor]], *, version: PolicyVersion) -> dict[str, float]:
        """Write the adapter tensors (peft's names) as a checked peft folder (`AdapterFolders`), load it into vLLM
        under a new adapter id, and serve every later request with it; the previous adapter is dropped once the
        new one has loaded. A refused tensor or a failed load raises `EngineError` and keeps the previous one."""
        from vllm.lora.request import LoRARequest

        assert self.adapters is not None
        started = time.perf_counter()
        try:
            folder, metrics = self.adapters.write(weights, version=version)
        except BucketError as error:
            raise EngineError(f"vLLM rejected adapter version {version}: {error}") from error
        previous = self.lora_request
        lora_id = 1 if previous is None else previous.lora_int_id + 1
        request = LoRARequest(f"sharpen-policy-{lora_id}", lora_id, str(folder))
        try:
            loaded = self.llm.llm_engine.add_lora(request)
        except Exception as error:  # vLLM raises what its loader raised
            raise EngineError(f"vLLM could not load adapter version {version} from {folder}: {error}") from error
        if not loaded:
            raise EngineError(f"vLLM did not load adapter version {version} from {folder}")
        if previous is not None:
            self.llm.llm_engine.remove_lora(previous.lora_int_id)
        self.lora_request = request
        self._drop_cached_results()
        self.policy_version = version
        return {**metrics, "sync/seconds": time.perf_counter() - started, "sync/num_buckets": 1.0}

    def _drop_cached_results(self) -> None:
        """After new weights: cached KV entries, and a vision-language model's cached image features, were computed
        with the old ones (sleep already dropped the KV cache)."""
        if not self._is_cache_asleep:
            self.llm.reset_prefix_cache()
        if self.requests.vision is not None:
            self.llm.llm_engine.reset_encoder_cache()

    @property
    def num_weight_group_members(self) -> int:
        return int(self.llm.llm_engine.vllm_config.parallel_config.world_size)

    def join_weight_group(
        self, *, master_addr: str, master_port: int, first_rank: int, world_size: int, backend: str
    ) -> None:
        """Every vLLM worker joins the weight group (`vllm_receiver.py`), so broadcasts land in the workers."""
        replies = self.llm.collective_rpc(
            "sharpen_join_weight_group", args=(master_addr, master_port, first_rank, world_size, backend)
        )
        check_joined(replies)

    def receive_broadcast(self, *, version: PolicyVersion) -> dict[str, float]:
        """Every worker takes the trainer's broadcast of version ``version`` straight into its model; a refusal
        (wrong version, corrupted or missing bucket) raises `EngineError` once the sync has been drained."""
        if self.is_asleep:
            raise EngineError("vLLM engine: receive_broadcast() while asleep (call wake_up() first)")
        started = time.perf_counter()
        replies = self.llm.collective_rpc("sharpen_receive_broadcast", args=(version,))
        check_broadcast(replies, version=version)
        self._drop_cached_results()
        self.policy_version = version
        return broadcast_metrics(replies, started=started)

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()
        if self.adapters is not None:
            self.adapters.close()
        engine = getattr(self.llm, "llm_engine", None)
        shutdown = getattr(engine, "shutdown", None)
        if callable(shutdown):
            shutdown()
        del self.llm


class RpcBucketTarget:
    """The sync protocol as collective RPCs to every vLLM worker; a worker's refusal becomes a `BucketError`.

    ``collective_rpc(method, args=...)`` blocks until every worker replied (`vllm.LLM.collective_rpc`, or the
    async engine's call run to completion on its loop)."""

    def __init__(self, collective_rpc: Callable[..., list[Any]]) -> None:
        self.collective_rpc = collective_rpc

    def _call(self, method: str, *args: Any) -> list[dict[str, Any]]:
        replies = self.collective_rpc(method, args=args)
        for rank, reply in enumerate(replies):
            if not reply.get("ok"):
                raise BucketError(f"worker {rank}: {reply.get('error')}")
        return replies

    def begin(self, sync_id: str, version: int) -> None:
        self._call("sharpen_begin_sync", sync_id, version)

    def load(self, manifest: BucketManifest) -> None:
        self._call("sharpen_load_bucket", manifest.to_dict())

    def abort(self, sync_id: str) -> None:
        self.collective_rpc("sharpen_abort_sync", args=(sync_id,))

    def finish(self, sync_id: str, num_buckets: int, checksum: str) -> dict[str, Any]:
        replies = self._call("sharpen_finish_sync", sync_id, num_buckets, checksum)
        agreed = [(r.get("version"), r.get("num_buckets"), r.get("checksum")) for r in replies]
        if any(fields != agreed[0] for fields in agreed):
            raise BucketError(f"workers disagree about the sync: {replies}")
        return max(replies, key=lambda reply: reply.get("load_seconds", 0.0))  # the slowest worker's timings
