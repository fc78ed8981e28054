"""A transformers engine: plain `generate` in this process. The fallback where vLLM cannot run, and the fast
engine of unit and integration tests with tiny models. A vision-language model (Qwen2-VL) also generates from image
prompts (`HfEngine.generate_with_images`), its pixel inputs computed by `data.vision.VisionProcessor`.

It holds its own copy of the model, so weight sync into it is a real copy, checked like any other engine's.
Every request is sampled with its own seed, as vLLM does: the last logits processor (`_PerRequestSampler`) draws
each row's token from the temperature/top-k/top-p distribution with that row's own `torch.Generator` and hands
transformers a one-hot choice, so what a request samples does not depend on which batch it shares (the episode
runner's batches depend on timing) and the behaviour logprobs are kept from that distribution: the truncated,
renormalised one, as vLLM's ``processed_logprobs``. transformers puts a caller's logits processors before its own
temperature/top-k/top-p warpers, so `generate` gets none of those settings and the sampler applies the same warpers
itself, in vLLM's order (temperature, top-k, top-p; transformers' `TopKLogitsWarper` and `TopPLogitsWarper` cut by
vLLM's rule). Requests without a
seed draw from torch's global generator, under a process-wide lock.

A Mixture-of-Experts model of a family `sharpen.expert_routes` knows returns its routes with each completion
(`Completion.routes`: every prompt token's and every generated token's experts, as its forward passes chose them, the
last sampled token's unknown: it never ran), for routing replay R3 (``trainer.moe.routing_replay = "r3"``).

Sleep (``runtime.colocate``) frees every parameter's storage; waking allocates them again filled with NaN, and
the next `load_weights` must replace every one of them (a weight it misses is an error, not stale numbers).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import (
    LogitsProcessor,
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from sharpen.data.vision import VisionProcessor, is_vision_model, model_class, text_only_error
from sharpen.environments.tool_formats.decode import completion_text
from sharpen.expert_routes import (
    UNROUTED,
    RouterReplay,
    Routes,
    expert_routes,
    is_moe_model,
    routes_tensor,
    stack_layers,
)
from sharpen.lm_head import keep_lm_head_float32
from sharpen.rollout.engines.base import EngineError
from sharpen.types import Completion, ExpertRoutes, ImagePart, PolicyVersion, SamplingParams

_GLOBAL_RNG = threading.Lock()
"""Held while a batch samples: rows without a seed, and transformers' own draw of the one-hot choice, use torch's one
global generator, which engines of this process (replicas behind a router, the async producer's) share."""


class HfEngine:
    def __init__(
        self,
        model_path: Path,
        *,
        dtype: str = "float32",
        device: str = "cpu",
        batch_size: int = 32,
        lm_head_float32: bool = False,
    ) -> None:
        """``lm_head_float32``: the LM head computes in float32 (`sharpen.lm_head`) whatever ``dtype`` is."""
        from transformers import AutoTokenizer

        self.device = torch.device(device)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.model = model_class(model_path).from_pretrained(model_path, dtype=getattr(torch, dtype))
        self.vision = VisionProcessor.from_pretrained(model_path) if is_vision_model(model_path) else None
        """A vision-language model's image processor (`generate_with_images`); None for a text-only model."""
        self.model_path = Path(model_path)
        # transformers wraps `to` with functools.wraps, which its stubs leave unbound (self is not passed)
        self.model.to(self.device).eval()  # pyright: ignore[reportArgumentType]
        if lm_head_float32:  # same weight (a tied head stays tied; weight syncs reach it), a float32 forward
            keep_lm_head_float32(self.model)
        self.router = RouterReplay(self.model, name=str(model_path)) if is_moe_model(self.model) else None
        """A Mixture-of-Experts model's routes, captured while it generates (`Completion.routes`)."""
        self.batch_size = batch_size
        self.pad_token_id = self.tokenizer.pad_token_id
        if self.pad_token_id is None:
            self.pad_token_id = self.tokenizer.eos_token_id
        self.policy_version: PolicyVersion = 0
        self._shapes: dict[str, torch.Size] | None = None
        """While asleep: the shape of each parameter whose storage was freed."""
        self._unloaded: set[str] = set()
        """Parameters woken up and not yet given a weight (their values are NaN)."""

    @property
    def is_asleep(self) -> bool:
        return self._shapes is not None

    def sleep(self) -> dict[str, float]:
        if self._shapes is not None:
            return {"colocate/freed_bytes": 0.0}
        shapes: dict[str, torch.Size] = {}
        freed = 0
        for name, param in self.model.named_parameters():  # tied weights appear once
            shapes[name] = param.shape
            freed += param.numel() * param.element_size()
            param.data = torch.empty(0, dtype=param.dtype, device=param.device)
        self._shapes = shapes
        return {"colocate/freed_bytes": float(freed)}

    def wake_up(self) -> dict[str, float]:
        if self._shapes is None:
            return {}
        parameters = dict(self.model.named_parameters())
        for name, shape in self._shapes.items():
            param = parameters[name]
            param.data = torch.full(shape, float("nan"), dtype=param.dtype, device=param.device)
        self._unloaded = set(self._shapes)
        self._shapes = None
        return {}

    def _check_awake(self, call: str) -> None:
        if self._shapes is not None:
            raise EngineError(f"HF engine: {call}() while asleep (call wake_up() and load_weights() first)")
        if self._unloaded:
            raise EngineError(
                f"HF engine: {call}() after wake_up() with {len(self._unloaded)} weights never loaded "
                f"(e.g. {sorted(self._unloaded)[0]!r})"
            )

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: list[SamplingParams]) -> list[Completion]:
        return self.generate_with_images(prompts, [()] * len(prompts), params)

    @torch.no_grad()
    def generate_with_images(
        self, prompts: list[list[int]], images: Sequence[tuple[ImagePart, ...]], params: list[SamplingParams]
    ) -> list[Completion]:
        """`generate` for prompts that hold image placeholders (`VisionProcessor.render_prompt`): ``images[i]`` are
        prompt i's images, in order (empty for a text prompt)."""
        self._check_awake("generate")
        self._check_takes_images(sum(len(row) for row in images))
        out: list[Completion] = []
        for start in range(0, len(prompts), self.batch_size):
            end = start + self.batch_size
            out.extend(self._generate_batch(prompts[start:end], params[start:end], images[start:end]))
        return out

    def _generate_batch(
        self, prompts: list[list[int]], params: list[SamplingParams], images: Sequence[tuple[ImagePart, ...]]
    ) -> list[Completion]:
        if len({_key(p) for p in params}) > 1:
            raise ValueError("the HF engine needs the same sampling settings (apart from seed) for a whole batch")
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros_like(input_ids)
        for row, ids in enumerate(prompts):  # left padding: every prompt ends where generation starts
            input_ids[row, width - len(ids) :] = torch.tensor(ids)
            attention_mask[row, width - len(ids) :] = 1
        image_inputs = self._image_inputs(input_ids.to(self.device), [image for row in images for image in row])
        with _GLOBAL_RNG:  # unseeded rows and transformers' own (one-hot) draw use torch's global generator
            return self._seeded_generate_batch(prompts, params, input_ids, attention_mask, width, image_inputs)

    def _seeded_generate_batch(
        self,
        prompts: list[list[int]],
        params: list[SamplingParams],
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        width: int,
        image_inputs: dict[str, torch.Tensor],
    ) -> list[Completion]:
        param = params[0]  # the settings are the same for the whole batch; the seeds are each request's
        eos = [self.tokenizer.eos_token_id, *param.stop_token_ids]
        sampler = None
        # temperature 0 means greedy (ReMax's baseline); otherwise sample with exactly the given settings, all applied
        # by the sampler (transformers would apply its warpers after it: no temperature, top-k or top-p of its own)
        if param.temperature > 0:
            sampler = _PerRequestSampler([p.seed for p in params], warpers=_warpers(param))
            sampling_kwargs: dict[str, Any] = {
                "do_sample": True,
                "temperature": 1.0,
                "top_p": 1.0,
                "top_k": 0,
                "logits_processor": LogitsProcessorList([sampler]),
            }
        else:
            sampling_kwargs = {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}
        capturing = self.router.capture(rows=len(prompts)) if self.router is not None else contextlib.nullcontext()
        with capturing as captured:
            # the auto class's return type does not satisfy `generate`'s self protocol in transformers' stubs
            result = self.model.generate(  # pyright: ignore[reportAttributeAccessIssue]
                input_ids=input_ids.to(self.device),
                attention_mask=attention_mask.to(self.device),
                **image_inputs,  # pixel values and the placeholders' types (M-RoPE positions) of an image prompt
                **sampling_kwargs,
                max_new_tokens=param.max_new_tokens,
                eos_token_id=eos,
                pad_token_id=self.pad_token_id,
                output_scores=True,
                return_dict_in_generate=True,
            )
        new_tokens = result.sequences[:, width:]  # [batch, steps]
        # [batch, width + steps - 1, layers, top_k]: the prefill's positions, then one per decoding step
        routes = None if captured is None else stack_layers(captured)
        if sampler is not None:  # the sampler kept the logprobs of its draws under temperature / top-k / top-p
            logprobs = torch.stack(sampler.logprobs, dim=1)  # [batch, steps]
        else:  # greedy: scores are the processed logits, their log-softmax the behaviour policy
            scores = torch.stack(result.scores, dim=1).float()  # [batch, steps, vocab]
            logprobs = torch.log_softmax(scores, dim=-1).gather(-1, new_tokens.unsqueeze(-1)).squeeze(-1)
        completions = []
        for row in range(len(prompts)):
            ids = new_tokens[row].tolist()
            num = len(ids)
            for position, token in enumerate(ids):
                if token in eos:
                    num = position + 1
                    break
            ids = ids[:num]
            finished = bool(ids) and ids[-1] in eos
            completions.append(
                Completion(
                    token_ids=ids,
                    logprobs=logprobs[row, :num].tolist(),
                    text=completion_text(self.tokenizer, ids),
                    finish_reason="stop" if finished else "length",
                    routes=None if routes is None else self._row_routes(routes[row], len(prompts[row]), width, num),
                )
            )
        return completions

    def _row_routes(self, routes: torch.Tensor, prompt_length: int, width: int, num_new: int) -> ExpertRoutes:
        """One row's routes (``routes``: [positions, layers, top_k] of its left-padded row) on its prompt and its
        ``num_new`` generated tokens, the last of which never ran."""
        assert self.router is not None
        ran = routes[width - prompt_length : width + num_new - 1]
        unknown = torch.full((1, *ran.shape[1:]), UNROUTED, dtype=ran.dtype, device=ran.device)
        return expert_routes(torch.cat([ran, unknown]), num_experts=self.router.num_experts)

    def _check_takes_images(self, num_images: int) -> None:
        if num_images and self.vision is None:
            raise text_only_error("HF engine", num_images, str(self.model_path))

    def _image_inputs(self, input_ids: torch.Tensor, images: Sequence[ImagePart]) -> dict[str, torch.Tensor]:
        """The model's pixel inputs of ``images`` (the rows' images in row order); none without images."""
        if self.vision is None:  # a text-only model: `_check_takes_images` refused any image
            return {}
        return self.vision.model_inputs(input_ids, images)

    @torch.no_grad()
    def score(self, token_ids: list[int], images: tuple[ImagePart, ...] = ()) -> list[float]:
        """`InferenceEngine.score`; ``images``: those the ids hold placeholders for (an image prompt's probe)."""
        self._check_awake("score")
        self._check_takes_images(len(images))
        ids = torch.tensor([token_ids], device=self.device)
        logits = self.model(input_ids=ids, **self._image_inputs(ids, images)).logits[0, :-1].float()
        return torch.log_softmax(logits, dim=-1).gather(-1, ids[0, 1:].unsqueeze(-1)).squeeze(-1).tolist()

    @torch.no_grad()
    def score_replaying(self, token_ids: list[int], routes: ExpertRoutes) -> list[float]:
        """`score` with every token routed as ``routes`` say (`RouteReplayingEngine`: the trainer's, for the
        weight-sync probe); a dense model has no routes to replay."""
        if self.router is None:
            raise EngineError(f"HF engine: routes to replay for {self.model_path}, which has no experts")
        indices = routes_tensor(routes).to(self.device)  # [tokens, layers, top_k]
        with self.router.replay(Routes(layers=list(indices.unbind(dim=1)))):
            return self.score(token_ids)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], *, version: PolicyVersion) -> dict[str, float]:
        if self._shapes is not None:
            raise EngineError("HF engine: load_weights() while asleep (call wake_up() first)")
        state = self.model.state_dict()
        # a weight is known by its storage: a tied weight may arrive under either of its names
        names_of: dict[int, str] = {param.data_ptr(): name for name, param in self.model.named_parameters()}
        num_tensors = 0
        for name, tensor in weights:
            if name not in state:
                raise KeyError(f"HF engine: unknown weight {name!r}")
            state[name].copy_(tensor)
            self._unloaded.discard(names_of.get(state[name].data_ptr(), name))
            num_tensors += 1
        if self._unloaded:
            raise EngineError(
                f"HF engine: weights version {version} left {len(self._unloaded)} woken weights unloaded "
                f"(e.g. {sorted(self._unloaded)[0]!r}); after wake_up() every weight must be loaded"
            )
        self.policy_version = version
        return {"sync/num_tensors": float(num_tensors)}

    def close(self) -> None:
        pass


def _warpers(params: SamplingParams) -> list[LogitsProcessor]:
    """The temperature, top-k and top-p warpers of ``params``, in vLLM's order (those that change anything)."""
    warpers: list[LogitsProcessor] = []
    if params.temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(params.temperature))
    if params.top_k > 0:
        warpers.append(TopKLogitsWarper(params.top_k))
    if params.top_p < 1.0:
        warpers.append(TopPLogitsWarper(params.top_p))
    return warpers


class _PerRequestSampler(LogitsProcessor):
    """The last logits processor: applies ``warpers`` (temperature, top-k, top-p) to the scores, draws each row's
    next token from that distribution with the row's own generator, records its logprob, and leaves only that token
    possible, so transformers' own draw (from torch's global generator) can pick nothing else. Rows without a seed
    draw from the global generator."""

    def __init__(self, seeds: list[int | None], *, warpers: list[LogitsProcessor]) -> None:
        super().__init__()
        self.warpers = warpers
        self.generators: list[torch.Generator | None] = []
        for seed in seeds:
            generator = None
            if seed is not None:
                generator = torch.Generator()
                generator.manual_seed(seed)
            self.generators.append(generator)
        self.logprobs: list[torch.Tensor] = []  # one [batch] tensor per step

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        warped = scores.float()
        for warper in self.warpers:
            warped = warper(input_ids, warped)  # pyright: ignore[reportArgumentType]
        logprobs = torch.log_softmax(warped, dim=-1).cpu()  # [batch, vocab], -inf outside a top-k / top-p cut
        probs = logprobs.exp()
        chosen = torch.stack(
            [torch.multinomial(probs[row], 1, generator=generator)[0] for row, generator in enumerate(self.generators)]
        )  # [batch]
        self.logprobs.append(logprobs.gather(-1, chosen.unsqueeze(-1)).squeeze(-1))
        only = torch.full_like(scores, float("-inf"))
        only[torch.arange(len(chosen)), chosen.to(scores.device)] = 0.0
        return only  # pyright: ignore[reportReturnType]


def _key(params: SamplingParams) -> tuple[int, float, float, int, tuple[int, ...]]:
    return (params.max_new_tokens, params.temperature, params.top_p, params.top_k, params.stop_token_ids)
