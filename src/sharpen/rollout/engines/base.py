"""The `InferenceEngine` protocol: token ids in; token ids and per-token logprobs out.

Engines know nothing of examples, rewards or the loop. Their logprobs are the behaviour policy's: logprobs of the
sampled tokens after temperature (and top-p, where set), so the trainer's importance ratio is exact when the
weights match. Each engine carries the `PolicyVersion` of the weights it holds; `load_weights` sets it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Protocol, cast, runtime_checkable

from sharpen.types import Completion, ExpertRoutes, ImagePart, PolicyVersion, SamplingParams

if TYPE_CHECKING:
    import torch


class InferenceEngine(Protocol):
    @property
    def policy_version(self) -> PolicyVersion:
        """The version of the weights the engine holds (set by `load_weights`)."""
        ...

    def generate(self, prompts: list[list[int]], params: list[SamplingParams]) -> list[Completion]:
        """One completion per prompt (repeat a prompt for several samples; give each its own seed)."""
        ...

    def score(self, token_ids: list[int]) -> list[float]:
        """Logprobs of ``token_ids[1:]`` given their prefixes, at temperature 1 (the weight-sync probe)."""
        ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], *, version: PolicyVersion) -> dict[str, float]:
        """Replace the engine's weights (full tensors, HF checkpoint names), record their version, and return
        timing metrics of the transfer (``sync/...``)."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class AsyncEngine(Protocol):
    """An engine that takes requests one at a time and batches them itself (continuous batching: an engine server,
    vLLM's async engine). Episodes await their own requests on it, with no batch formed on sharpen's side."""

    async def generate_async(self, prompt: list[int], params: SamplingParams) -> Completion:
        """One completion, awaitable from any event loop, with ``versions`` set: the policy version each token
        was sampled with (a request that spans a weight update has tokens of two versions)."""
        ...


@runtime_checkable
class AsyncImageEngine(Protocol):
    """An `AsyncEngine` that also takes image prompts one at a time (vLLM's async engine with a vision-language
    model)."""

    async def generate_async_with_images(
        self, prompt: list[int], images: tuple[ImagePart, ...], params: SamplingParams
    ) -> Completion:
        """`AsyncEngine.generate_async` of a prompt whose ids hold placeholders for ``images``."""
        ...


def request_level(engine: InferenceEngine) -> AsyncEngine | None:
    """``engine`` as an `AsyncEngine` when it and every replica behind it take requests one at a time, else None
    (batch engines get their requests grouped by `RequestBatcher`)."""
    if not isinstance(engine, AsyncEngine):
        return None
    replicas = replicas_of(engine)  # a router's serving replicas: none while all are down, then batches wait too
    return engine if replicas and all(isinstance(replica, AsyncEngine) for replica in replicas) else None


@runtime_checkable
class ImageEngine(Protocol):
    """An engine that also generates from image prompts (a vision-language model's): the `hf` engine, the
    in-process `vllm` engine, and what routes to them (the router, the Ray engine actors' proxies)."""

    def generate_with_images(
        self, prompts: list[list[int]], images: Sequence[tuple[ImagePart, ...]], params: list[SamplingParams]
    ) -> list[Completion]:
        """`InferenceEngine.generate` for prompts whose ids hold image placeholders (`VisionProcessor.render_prompt`):
        ``images[i]`` are prompt i's images, in order. A text-only model given images raises `ValueError`."""
        ...

    def score(self, token_ids: list[int], images: tuple[ImagePart, ...] = ()) -> list[float]:
        """`InferenceEngine.score` of ids that hold placeholders for ``images`` (an image prompt's probe)."""
        ...


def takes_no_images(engine: object) -> EngineError:
    """The one error for image prompts given to an engine that takes none."""
    return EngineError(f"{type(engine).__name__} takes no image prompts yet (the hf and vllm engines do)")


def generate_prompts(
    engine: InferenceEngine,
    prompts: list[list[int]],
    images: Sequence[tuple[ImagePart, ...]],
    params: list[SamplingParams],
) -> list[Completion]:
    """``engine.generate``, or `ImageEngine.generate_with_images` when a prompt holds images (``images[i]``: prompt
    i's); an engine that takes no images is an `EngineError` saying so."""
    if not any(images):
        return engine.generate(prompts, params)
    if not isinstance(engine, ImageEngine):
        raise takes_no_images(engine)
    return engine.generate_with_images(prompts, images, params)


def generate_each(
    engine: InferenceEngine,
    prompts: list[list[int]],
    images: Sequence[tuple[ImagePart, ...]],
    params: list[SamplingParams],
) -> list[Completion | EngineInputError]:
    """`generate_prompts`, where a request the engine refuses for its own input fails alone. An engine that refuses
    a batch (`EngineInputError`: one prompt past its context) is asked again one request at a time; a refused
    request's entry is its `EngineInputError`, every other entry its completion (the batch's own, on an engine that
    honours per-request seeds). Any other error fails the whole call, as before."""
    try:
        return list(generate_prompts(engine, prompts, images, params))
    except EngineInputError as error:
        if len(prompts) == 1:
            return [error]
    answers: list[Completion | EngineInputError] = []
    for prompt, row, row_params in zip(prompts, images, params, strict=True):
        try:
            answers.extend(generate_prompts(engine, [prompt], [row], [row_params]))
        except EngineInputError as error:
            answers.append(error)
    return answers


def score_prompt(engine: InferenceEngine, token_ids: list[int], images: tuple[ImagePart, ...] = ()) -> list[float]:
    """``engine.score``, passing ``images`` (those the ids hold placeholders for) to an engine that takes images;
    an engine that takes none is an `EngineError` saying so."""
    if not images:
        return engine.score(token_ids)
    if not isinstance(engine, ImageEngine):
        raise takes_no_images(engine)
    return cast(ImageEngine, engine).score(token_ids, images)  # both protocols name score: take the image one


@runtime_checkable
class SleepableEngine(Protocol):
    """An engine that can give its memory back while a colocated trainer steps (``runtime.colocate``)."""

    def sleep(self) -> dict[str, float]:
        """Free the weights and any cache (the weights are discarded, not kept elsewhere: the weight sync after the
        step brings new ones). Returns ``colocate/freed_bytes``. Generating or scoring while asleep is an error."""
        ...

    def wake_up(self) -> dict[str, float]:
        """Take the memory back for the weights; their content is undefined until the next `load_weights`, which
        must then replace every weight."""
        ...


@runtime_checkable
class WeightGroupEngine(Protocol):
    """An engine whose own processes join the broadcast weight group and receive the weights themselves (vLLM's
    workers), instead of its host process receiving them and calling `load_weights`."""

    @property
    def num_weight_group_members(self) -> int:
        """How many ranks of the weight group the engine's processes take (vLLM: one per worker)."""
        ...

    def join_weight_group(
        self, *, master_addr: str, master_port: int, first_rank: int, world_size: int, backend: str
    ) -> None:
        """Its processes join the group as ranks ``first_rank`` ... ``first_rank + num_weight_group_members - 1``."""
        ...

    def receive_broadcast(self, *, version: PolicyVersion) -> dict[str, float]:
        """Take one broadcast sync (verified bucket by bucket) and hold version ``version``; ``sync/*`` metrics."""
        ...


@runtime_checkable
class ReplicatedEngine(Protocol):
    """An engine that fronts several replicas (a router): a weight sync is verified on each of them."""

    @property
    def replicas(self) -> Sequence[InferenceEngine]:
        """The replicas serving now (a router leaves out those that are down or wait for weights)."""
        ...


@runtime_checkable
class RestartableEngine(Protocol):
    """An engine that can come back after it failed (an engine server): the router restarts a failed replica
    through it, in the background."""

    def restart(self) -> None:
        """Bring the engine back and block until it serves: a server sharpen started is stopped (what is left of
        its process group) and started again on the same address; a server at a URL sharpen did not start cannot
        be restarted from here, so the engine waits until it answers again. Afterwards the engine reports policy
        version 0 (the weights it boots with), whatever it held before: it takes the run's weights at the next
        `load_weights`. Raises `EngineError` when it cannot come back, e.g. after joining a broadcast weight group
        (`WeightGroupEngine`), whose fixed size a new process cannot rejoin."""
        ...


@runtime_checkable
class RouteReplayingEngine(Protocol):
    """An engine that can score with given Mixture-of-Experts routes (the `hf` engine): the weight-sync probe replays
    the trainer's routes in it, so the check compares weights, not a route that one side's rounding flipped."""

    def score_replaying(self, token_ids: list[int], routes: ExpertRoutes) -> list[float]:
        """`InferenceEngine.score` with every token routed as ``routes`` say (``[tokens, layers, top_k]`` over
        ``token_ids``)."""
        ...


@runtime_checkable
class ProbedElsewhere(Protocol):
    """An engine in another process (a Ray engine actor's proxy): the weight-sync probe runs `probe_engine` where
    the engine is, which knows whether it can replay routes."""

    def probe(self, token_ids: list[int], routes: ExpertRoutes | None) -> tuple[list[float], bool]:
        """`probe_engine` on the engine itself."""
        ...


def probe_engine(
    engine: InferenceEngine, token_ids: list[int], routes: ExpertRoutes | None
) -> tuple[list[float], bool]:
    """``engine``'s probe logprobs of ``token_ids``, and whether they replayed ``routes`` (an engine that can,
    given routes, wherever it runs; the others score with their own)."""
    if isinstance(engine, ProbedElsewhere):
        return engine.probe(token_ids, routes)
    if routes is not None and isinstance(engine, RouteReplayingEngine):
        return engine.score_replaying(token_ids, routes), True
    return engine.score(token_ids), False


@runtime_checkable
class MeteredEngine(Protocol):
    """An engine that counts what happened to it between steps (a router: retries, restarts, load per replica)."""

    def pop_metrics(self) -> dict[str, float]:
        """The counts since the last call (the step's), then start counting again."""
        ...


def pop_engine_metrics(engine: object) -> dict[str, float]:
    """``engine``'s counts since the last call where it keeps any (`MeteredEngine`), else nothing."""
    return engine.pop_metrics() if isinstance(engine, MeteredEngine) else {}


def replicas_of(engine: InferenceEngine) -> list[InferenceEngine]:
    """The replicas behind ``engine`` (a router's), or the engine itself."""
    return list(engine.replicas) if isinstance(engine, ReplicatedEngine) else [engine]


@runtime_checkable
class FreezableWeights(Protocol):
    """Weights held in another process (a Ray trainer actor's): iterating fetches them, `freeze` pins this version
    once (an object-store copy) so that several replicas can read it without fetching it again."""

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]: ...

    def freeze(self) -> Iterable[tuple[str, torch.Tensor]]: ...


class EngineError(RuntimeError):
    """The engine failed in a way the run cannot recover from (the message names the engine and the cause)."""


class EngineInputError(EngineError):
    """The engine refused one request for that request's own input (a prompt longer than the model's context, a
    malformed request), not because it failed: it goes on serving the others. The agent endpoint answers such a
    call 400 and the run goes on; where nothing handles it, it is an `EngineError` like any other."""


class EngineUnavailable(EngineError):
    """The engine could not serve a request because it is down, unreachable, stuck or failing as a whole
    (connection refused or reset, no answer in time, an HTTP 5xx, its process gone), not because of the request:
    another replica may serve the same request (the router sends it there), and this one may come back after a
    restart. Alone, with nowhere else to send the request, it stops the run like any `EngineError`."""


def device_free_bytes() -> int:
    """Free memory of this process's current CUDA device (0 without CUDA): an engine's workers or server are other
    processes, so what a `SleepableEngine` frees shows only device-wide (its ``colocate/freed_bytes``)."""
    import torch

    if not torch.cuda.is_available():
        return 0
    free, _total = torch.cuda.mem_get_info()
    return int(free)


def sleepable(engine: object, *, name: str = "the engine") -> SleepableEngine:
    """``engine`` as a `SleepableEngine`, or an `EngineError` saying that it cannot sleep."""
    if not isinstance(engine, SleepableEngine):
        raise EngineError(f"{name} ({type(engine).__name__}) cannot sleep, which runtime.colocate needs")
    return engine
