"""A stand-in SGLang server for tests: the native HTTP routes the `sglang` engine uses, with SGLang 0.5.23's request
and response schemas, in front of a real engine (sharpen's `HfEngine` on the given model).

What it keeps of SGLang (read from ``srt/entrypoints/http_server.py``, ``srt/managers/io_struct.py``,
``srt/sampling/sampling_params.py`` and the JSON contract ``api/v1/api_types.py``):

- ``/generate``: unknown top-level keys are ignored; unknown or mistyped ``sampling_params`` keys are refused with
  HTTP 400 ``{"error": "unknown field `x`, expected one of ..."}`` (the contract's text); out-of-range values with
  HTTP 400 ``{"error": {"message": ...}}`` (SamplingParams.verify's text). The answer is ``{"text", "output_ids",
  "meta_info"}``, with ``finish_reason`` ``{"type": "stop", "matched": id}`` or ``{"type": "length", "length": n}``,
  ``[logprob, token_id, null]`` triples in ``output_token_logprobs`` / ``input_token_logprobs`` (the prompt's from
  ``logprob_start_len``, the first position's logprob null), ``weight_version`` and ``weight_versions`` spans.
  Temperature 0 is greedy. Output logprobs are SGLang's: ``log softmax(logits / temperature)`` of the sampled
  token, before any top-p cut. ``sampling_seed`` is honoured, as on a server started with
  --enable-deterministic-inference.
- control routes take SGLang's bodies (pydantic validation: a missing required field is HTTP 422, unknown keys are
  ignored) and answer as it does: ``/update_weights_from_disk`` loads the ``*.safetensors`` files of ``model_path``
  into the engine (``{"success", "message", "num_paused_requests"}``, HTTP 400 on failure, the old weights kept)
  and then reports that folder as its ``model_path`` and ``served_model_name``, as SGLang does; ``/pause_generation``
  holds new requests until ``/continue_generation``; ``/update_weight_version`` (its ``abort_all_requests``, true by
  default in SGLang, is not acted on); ``/release_memory_occupation`` / ``/resume_memory_occupation`` by tag (a
  no-op without the memory saver, HTTP 400 while requests run or for a tag not released).

What it does not: text prompts, batches, streaming, n > 1, top-k/min-p and penalties (refused with HTTP 400
"stand-in: ..."). Its requests are atomic, so a pause in any mode waits for the running ones to finish.

Test hooks (not routes): `SglangStandin.hang` (every route stops answering until `answer`), `abort_next` (the next
requests finish with an abort, as after /abort_request), `reset` (original weights, model path and version),
``events`` (the control routes called, in order).

Run in a background thread with `SglangStandin.start`, or as a program that takes the `sglang.launch_server` flags
the engine passes: ``python tests/support/sglang_standin.py --model-path PATH --port N ...``.
"""

from __future__ import annotations

import argparse
import asyncio
import threading
import time
import uuid
from pathlib import Path
from typing import Annotated, Any, Literal

import torch
import uvicorn
from fastapi import Body, FastAPI, Query, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from sharpen.rollout.engines.hf import HfEngine
from sharpen.rollout.engines.server import free_port
from sharpen.types import SamplingParams

VERSION = "0.5.23"
"""The SGLang version whose API this stand-in speaks (reported by /get_server_info)."""

SAMPLING_FIELDS = (
    "max_new_tokens",
    "stop",
    "stop_token_ids",
    "stop_regex",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "min_new_tokens",
    "n",
    "json_schema",
    "regex",
    "ebnf",
    "structural_tag",
    "ignore_eos",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "no_stop_trim",
    "stream_interval",
    "logit_bias",
    "sampling_seed",
    "custom_params",
    "beam_width",
    "watermark",
    "choice",
)
"""The keys SGLang's JSON contract admits in ``sampling_params`` (any other is refused)."""

_UNSUPPORTED: dict[str, object] = {
    "top_k": -1,
    "min_p": 0.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "n": 1,
    "stop": None,
    "min_new_tokens": 0,
}
"""Sampling settings the stand-in refuses unless given their neutral value."""
_MEMORY_TAGS = ("kv_cache", "weights", "cuda_graph")


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class UpdateWeightFromDiskBody(_Body):
    model_path: str
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | None = None
    is_async: bool = False
    torch_empty_cache: bool = False
    keep_pause: bool = False
    recapture_cuda_graph: bool = False
    token_step: int = 0
    flush_cache: bool = True


class UpdateWeightVersionBody(_Body):
    new_version: str
    abort_all_requests: bool = True


class PauseGenerationBody(_Body):
    mode: Literal["abort", "retract", "in_place"] = "abort"


class ContinueGenerationBody(_Body):
    torch_empty_cache: bool = True


class MemoryOccupationBody(_Body):
    tags: list[str] | None = None


class _ContractError(ValueError):
    """A body the JSON contract refuses (HTTP 400 ``{"error": text}``)."""


class _RequestError(ValueError):
    """A request SGLang refuses after parsing it (HTTP 400 ``{"error": {"message": text}}``)."""


def _unexpected(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"boolean `{str(value).lower()}`"
    if isinstance(value, int):
        return f"integer `{value}`"
    if isinstance(value, float):
        return f"floating point `{value}`"
    if isinstance(value, str):
        return f'string "{value}"'
    if isinstance(value, list):
        return "sequence"
    return "map"


def _int(value: object, what: str = "i64") -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _ContractError(f"invalid type: {_unexpected(value)}, expected {what}")
    return value


def _float(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _ContractError(f"invalid type: {_unexpected(value)}, expected f64")
    return float(value)


def _bool(value: object) -> bool:
    if not isinstance(value, bool):
        raise _ContractError(f"invalid type: {_unexpected(value)}, expected a boolean")
    return value


def _token_ids(value: object) -> list[int]:
    if not isinstance(value, list):
        raise _ContractError(f"invalid type: {_unexpected(value)}, expected a sequence")
    if value and isinstance(value[0], list):
        raise _RequestError("stand-in: batched input_ids are not supported")
    return [_int(token) for token in value]


class SglangStandin:
    """The stand-in server on ``host:port`` (0: a free port) in front of an `HfEngine` on ``model_path``."""

    def __init__(
        self,
        model_path: Path,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        served_model_name: str | None = None,
        weight_version: str = "default",
        memory_saver: bool = True,
        deterministic: bool = True,
        random_seed: int | None = None,
        dtype: str = "float32",
    ) -> None:
        self.host = host
        self.port = port or free_port(host)
        self.model_path = str(model_path)
        self.served_model_name = served_model_name or self.model_path
        self.weight_version = weight_version
        self.memory_saver = memory_saver
        self.deterministic = deterministic
        self.random_seed = random_seed
        self.dtype = dtype
        self.engine = HfEngine(model_path, dtype=dtype)
        self._original = {name: tensor.clone() for name, tensor in self.engine.model.state_dict().items()}
        self._initial = (self.model_path, self.served_model_name, weight_version)
        self.events: list[str] = []
        """The control routes called, in order (``"pause_generation:retract"``, ``"update_weights_from_disk"``)."""
        self._model_lock = threading.Lock()
        self._state = threading.Condition()
        self._paused = False
        self._in_flight = 0
        self._aborts = 0
        self._hung = threading.Event()
        self._stopping = threading.Event()
        self._released: set[str] = set()
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self.app = self._build_app()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    # --- running -----------------------------------------------------------------------------------------------

    def _uvicorn_config(self) -> uvicorn.Config:
        return uvicorn.Config(
            self.app, host=self.host, port=self.port, log_level="warning", lifespan="off", timeout_graceful_shutdown=1
        )

    def start(self, timeout_s: float = 30.0) -> str:
        """Serve in a daemon thread; returns the URL once it answers."""
        self._server = uvicorn.Server(self._uvicorn_config())
        self._thread = threading.Thread(target=self._server.run, name="sglang-standin", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the SGLang stand-in did not start on {self.url}")
            time.sleep(0.02)
        return self.url

    def serve_forever(self) -> None:
        uvicorn.Server(self._uvicorn_config()).run()

    def stop(self) -> None:
        self._stopping.set()
        self._hung.clear()
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)

    # --- test hooks --------------------------------------------------------------------------------------------

    def hang(self) -> None:
        """Every route stops answering (requests wait) until `answer`."""
        self._hung.set()

    def answer(self) -> None:
        self._hung.clear()

    def abort_next(self, count: int) -> None:
        """The next ``count`` generate requests finish with an abort without a status (as after /abort_request)."""
        with self._state:
            self._aborts = count

    def reset(self) -> None:
        """Back to the state at start: the original weights, model path, weight version; awake and not paused."""
        with self._model_lock:
            if self.engine.is_asleep:
                self.engine.wake_up()
            self.engine.load_weights(self._original.items(), version=0)
        with self._state:
            self._paused = False
            self._aborts = 0
            self._released.clear()
            self._state.notify_all()
        self.model_path, self.served_model_name, self.weight_version = self._initial
        self._hung.clear()
        self.events.clear()

    # --- the app -----------------------------------------------------------------------------------------------

    def _build_app(self) -> FastAPI:
        app = FastAPI()

        @app.middleware("http")
        async def gate(request: Request, call_next: Any) -> Any:
            while self._hung.is_set() and not self._stopping.is_set():
                await asyncio.sleep(0.05)
            return await call_next(request)

        @app.get("/health")
        @app.get("/health_generate")
        async def health() -> Response:
            return Response(status_code=200)

        @app.get("/get_model_info")
        @app.get("/model_info")
        async def model_info() -> dict[str, Any]:
            return {
                "model_path": self.model_path,
                "served_model_name": self.served_model_name,
                "tokenizer_path": self._initial[0],
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": self.weight_version,
                "load_format": "auto",
                "reasoning_parser": None,
                "tool_call_parser": None,
                "disaggregation_mode": "null",
                "has_image_understanding": False,
                "has_audio_understanding": False,
                "model_type": "llama",
                "architectures": ["LlamaForCausalLM"],
            }

        @app.get("/get_server_info")
        @app.get("/server_info")
        async def server_info() -> dict[str, Any]:
            return {
                "model_path": self._initial[0],
                "served_model_name": self._initial[1],
                "host": self.host,
                "port": self.port,
                "dtype": self.dtype,
                "random_seed": self.random_seed,
                "tp_size": 1,
                "enable_memory_saver": self.memory_saver,
                "enable_deterministic_inference": self.deterministic,
                "weight_version": self._initial[2],
                "internal_states": [{}],
                "version": VERSION,
                "frontend": "python",
            }

        @app.api_route("/generate", methods=["POST", "PUT"])
        async def generate(request: Request) -> Response:
            try:
                body = await request.json()
            except ValueError:
                return JSONResponse({"detail": [{"type": "json_invalid", "msg": "JSON decode error"}]}, 422)
            try:
                answer = await asyncio.to_thread(self._generate, body)
            except _ContractError as error:
                return JSONResponse({"error": str(error)}, 400)
            except _RequestError as error:
                return JSONResponse({"error": {"message": str(error)}}, 400)
            return JSONResponse(answer)

        @app.api_route("/flush_cache", methods=["GET", "POST"])
        def flush_cache(timeout: Annotated[float, Query(ge=0.0)] = 0.0) -> Response:
            with self._state:
                idle = self._paused or self._in_flight == 0
            if not idle:
                return Response("Flush cache failed.\n", status_code=400)
            self.events.append("flush_cache")
            return Response(
                "Cache flushed.\nPlease check backend logs for more details. (When there are running or waiting "
                "requests, the operation will not be performed.)\n"
            )

        @app.post("/update_weights_from_disk")
        def update_weights_from_disk(obj: Annotated[UpdateWeightFromDiskBody, Body()]) -> JSONResponse:
            self.events.append("update_weights_from_disk")
            success, message = self._load_from_disk(obj)
            content = {"success": success, "message": message, "num_paused_requests": 0}
            return JSONResponse(content, 200 if success else 400)

        @app.post("/update_weight_version")
        def update_weight_version(obj: Annotated[UpdateWeightVersionBody, Body()]) -> JSONResponse:
            self.events.append(f"update_weight_version:{obj.new_version}")
            self.weight_version = obj.new_version
            message = f"Weight version updated to {obj.new_version}"
            return JSONResponse({"success": True, "message": message, "new_version": obj.new_version})

        @app.post("/pause_generation")
        def pause_generation(obj: Annotated[PauseGenerationBody, Body()]) -> JSONResponse:
            self.events.append(f"pause_generation:{obj.mode}")
            with self._state:
                self._paused = True
                self._state.wait_for(lambda: self._in_flight == 0)  # its requests cannot stop half-way
            return JSONResponse({"message": "Generation paused successfully.", "status": "ok"})

        @app.post("/continue_generation")
        def continue_generation(obj: Annotated[ContinueGenerationBody, Body()]) -> JSONResponse:
            self.events.append("continue_generation")
            with self._state:
                self._paused = False
                self._state.notify_all()
            return JSONResponse({"message": "Generation continued successfully.", "status": "ok"})

        @app.api_route("/release_memory_occupation", methods=["GET", "POST"])
        def release_memory_occupation(obj: Annotated[MemoryOccupationBody, Body()]) -> Response:
            self.events.append("release_memory_occupation")
            tags = obj.tags or list(_MEMORY_TAGS)
            with self._state:
                if self._in_flight and not self._paused:
                    return _error("release_memory_occupation should be called only when server is idle.")
            if not self.memory_saver:  # SGLang's adapter without the memory saver does nothing
                return JSONResponse(None)
            self._released.update(tags)
            if "weights" in tags:
                with self._model_lock:
                    self.engine.sleep()
            return JSONResponse(None)

        @app.api_route("/resume_memory_occupation", methods=["GET", "POST"])
        def resume_memory_occupation(obj: Annotated[MemoryOccupationBody, Body()]) -> Response:
            self.events.append("resume_memory_occupation")
            tags = obj.tags or list(_MEMORY_TAGS)
            if not self.memory_saver:
                return JSONResponse(None)
            missing = [tag for tag in tags if tag not in self._released]
            if missing:
                return _error(repr(missing[0]))
            self._released.difference_update(tags)
            if "weights" in tags:
                with self._model_lock:
                    self.engine.wake_up()
            return JSONResponse(None)

        return app

    # --- generation --------------------------------------------------------------------------------------------

    def _generate(self, body: object) -> dict[str, Any]:
        if not isinstance(body, dict):
            raise _ContractError(f"invalid type: {_unexpected(body)}, expected struct GenerateRequest")
        if body.get("stream"):
            raise _RequestError("stand-in: streaming is not supported")
        if body.get("input_ids") is None:
            raise _RequestError("stand-in: only input_ids prompts are supported")
        prompt = _token_ids(body["input_ids"])
        raw = body.get("sampling_params") or {}
        if not isinstance(raw, dict):
            raise _ContractError(f"invalid type: {_unexpected(raw)}, expected struct SamplingParams")
        return_logprob = body.get("return_logprob")
        return_logprob = False if return_logprob is None else _bool(return_logprob)
        start = body.get("logprob_start_len")
        start = -1 if start is None else _int(start)
        params = _sampling_params(raw)
        if not prompt:
            raise _RequestError("The input_ids should not be empty.")
        with self._state:
            self._state.wait_for(lambda: not self._paused)
            self._in_flight += 1
            aborted = self._aborts > 0
            self._aborts -= int(aborted)
        try:
            with self._model_lock:
                if self._released & {"kv_cache", "weights"}:
                    raise _RequestError("stand-in: generate while the memory is released")
                version = self.weight_version
                completion = None
                if params.max_new_tokens > 0 and not aborted:
                    [completion] = self.engine.generate([prompt], [params])
                input_logprobs: list[float | None] = [None, *self.engine.score(prompt)] if start >= 0 else []
                token_ids = completion.token_ids if completion is not None else []
                logprobs = completion.logprobs if completion is not None else []
                if completion is not None and params.temperature > 0 and params.top_p < 1.0:
                    logprobs = self._temperature_logprobs(prompt, token_ids, params.temperature)
        finally:
            with self._state:
                self._in_flight -= 1
                self._state.notify_all()
        if aborted:
            reason: dict[str, Any] = {"type": "abort", "message": "Aborted", "status_code": None}
        elif completion is not None and completion.finish_reason == "stop":
            reason = {"type": "stop", "matched": token_ids[-1]}
        else:
            reason = {"type": "length", "length": params.max_new_tokens}
        meta: dict[str, Any] = {
            "id": uuid.uuid4().hex,
            "finish_reason": reason,
            "prompt_tokens": len(prompt),
            "weight_version": version,
            "num_retractions": 0,
            "reasoning_tokens": 0,
            "completion_tokens": len(token_ids),
            "cached_tokens": 0,
            "weight_versions": [{"version": version, "start": 0, "end": len(token_ids)}],
            "e2e_latency": 0.0,
        }
        if return_logprob:
            positions = range(start, len(prompt)) if start >= 0 else range(0)
            meta["input_token_logprobs"] = [[input_logprobs[i], prompt[i], None] for i in positions]
            meta["output_token_logprobs"] = [[lp, token, None] for lp, token in zip(logprobs, token_ids, strict=True)]
            meta["output_token_logprobs_length"] = len(token_ids)
        text = completion.text if completion is not None else ""
        return {"text": text, "output_ids": token_ids, "meta_info": meta}

    @torch.no_grad()
    def _temperature_logprobs(self, prompt: list[int], completion: list[int], temperature: float) -> list[float]:
        """SGLang's output logprobs: the sampled tokens' under ``softmax(logits / temperature)``, no top-p cut."""
        ids = torch.tensor([prompt + completion])
        logits = self.engine.model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
        logprobs = torch.log_softmax(logits / temperature, dim=-1)
        return logprobs.gather(-1, ids[0, len(prompt) :].unsqueeze(-1)).squeeze(-1).tolist()

    # --- weights -----------------------------------------------------------------------------------------------

    def _load_from_disk(self, obj: UpdateWeightFromDiskBody) -> tuple[bool, str]:
        from safetensors.torch import load_file

        folder = Path(obj.model_path)
        files = sorted(folder.glob("*.safetensors")) if folder.is_dir() else []
        if not files:
            return False, f"Failed to get weights iterator: no safetensors files in {obj.model_path}."
        with self._model_lock:
            state = self.engine.model.state_dict()
            backup = {name: tensor.clone() for name, tensor in state.items()}
            try:
                weights = ((name, tensor) for file in files for name, tensor in load_file(file).items())
                self.engine.load_weights(weights, version=0)  # its versions are the strings SGLang keeps
            except Exception as error:
                for name, tensor in backup.items():
                    state[name].copy_(tensor)
                return False, f"Failed to update weights: {error!r}.\nRolling back to original weights."
        self.model_path = self.served_model_name = obj.model_path
        message = "Succeeded to update model weights."
        if obj.weight_version is not None:
            self.weight_version = obj.weight_version
            message += f" Weight version updated to {obj.weight_version}."
        return True, message


def _sampling_params(raw: dict[str, Any]) -> SamplingParams:
    """sharpen's settings from SGLang's ``sampling_params`` (the contract's checks, then SGLang's verify)."""
    for key in raw:
        if key not in SAMPLING_FIELDS:
            listed = ", ".join(f"`{field}`" for field in SAMPLING_FIELDS)
            raise _ContractError(f"unknown field `{key}`, expected one of {listed}")
    max_new_tokens = 128 if raw.get("max_new_tokens") is None else _int(raw["max_new_tokens"])
    temperature = 1.0 if raw.get("temperature") is None else _float(raw["temperature"])
    top_p = 1.0 if raw.get("top_p") is None else _float(raw["top_p"])
    seed = None if raw.get("sampling_seed") is None else _int(raw["sampling_seed"])
    stop = raw.get("stop_token_ids")
    stop_token_ids = () if stop is None else tuple(_token_ids(stop))
    for key, neutral in _UNSUPPORTED.items():
        if raw.get(key) not in (None, neutral):
            raise _RequestError(f"stand-in: sampling_params.{key} is not supported")
    if temperature < 0.0:
        raise _RequestError(f"temperature must be a non-negative finite number, got {temperature}.")
    if not 0.0 < top_p <= 1.0:
        raise _RequestError(f"top_p must be in (0, 1], got {top_p}.")
    if max_new_tokens < 0:
        raise _RequestError(f"max_new_tokens must be at least 0, got {max_new_tokens}.")
    return SamplingParams(
        max_new_tokens=max_new_tokens,
        temperature=0.0 if temperature < 1e-6 else temperature,
        top_p=top_p,
        seed=seed,
        stop_token_ids=stop_token_ids,
    )


def _error(message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message}}, 400)


def main(argv: list[str] | None = None) -> None:
    """Serve in the foreground, taking the `sglang.launch_server` flags the `sglang` engine passes."""
    parser = argparse.ArgumentParser(description="A stand-in SGLang server in front of an HfEngine.")
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--random-seed", type=int)
    parser.add_argument("--tp-size", type=int, default=1)
    parser.add_argument("--weight-version", default="default")
    parser.add_argument("--mem-fraction-static", type=float)
    parser.add_argument("--served-model-name")
    parser.add_argument("--enable-memory-saver", action="store_true")
    parser.add_argument("--enable-deterministic-inference", action="store_true")
    args = parser.parse_args(argv)
    standin = SglangStandin(
        Path(args.model_path),
        host=args.host,
        port=args.port,
        served_model_name=args.served_model_name,
        weight_version=args.weight_version,
        memory_saver=args.enable_memory_saver,
        deterministic=args.enable_deterministic_inference,
        random_seed=args.random_seed,
        dtype="float32" if args.dtype == "auto" else args.dtype,
    )
    print(f"SGLang stand-in {VERSION} serving {args.model_path} on {standin.url}", flush=True)
    standin.serve_forever()


if __name__ == "__main__":
    main()
