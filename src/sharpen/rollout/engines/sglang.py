"""The SGLang engine: an SGLang server (``python -m sglang.launch_server``) spoken to through its native HTTP API,
either at ``config.url`` or started by sharpen (where the ``sglang`` package is installed: CUDA machines).

Owns the SGLang side of a server engine: the routes, their request and response fields, and what they mean for
sharpen. Transport, timeouts and the server's life (starting, restarting, closing: `ServerEngine`) are
`server.py`'s. Written against SGLang 0.5.23 (its ``srt/entrypoints/http_server.py``, ``srt/managers/io_struct.py``,
``srt/sampling/sampling_params.py`` and the JSON contract ``api/v1/api_types.py``).

- Starting: ``python -m sglang.launch_server --model-path --host --port --dtype --random-seed --tp-size
  --weight-version 0`` (+ --mem-fraction-static, --served-model-name, --enable-memory-saver,
  --enable-deterministic-inference, ``extra_args``), ready when ``GET /health`` answers 200.
- Connecting: ``GET /get_model_info`` (0.5.23 deprecates it for ``/model_info``, which older servers lack) must
  answer with SGLang's fields (``model_path``, ``is_generation``); its ``model_path`` or ``served_model_name``
  must be ``config.served_model_name`` or the run's model path. A server that updated its weights from disk
  reports the snapshot's folder there instead (SGLang moves both names to it), so it no longer passes. Its
  ``weight_version`` (a string, "default" unless started with --weight-version) is set to "0" through
  ``POST /update_weight_version`` (with ``abort_all_requests`` false, which is not SGLang's default).
  ``GET /get_server_info`` gives the version and whether the memory saver and deterministic inference are on.
- Generating: ``POST /generate`` with ``input_ids``, ``sampling_params`` (``max_new_tokens``, ``temperature``
  (0: SGLang samples greedily with top_k 1), ``top_p``, ``top_k`` (sent only when set; SGLang's -1 is off),
  ``stop_token_ids``, ``sampling_seed``) and
  ``return_logprob``. The answer's ``output_ids`` are the tokens (a stop token included) and
  ``meta_info.output_token_logprobs`` their ``[logprob, token_id, text]`` triples. Unknown keys in
  ``sampling_params`` are refused (HTTP 400), unknown top-level keys ignored.
- Logprobs: SGLang returns ``log softmax(logits / temperature)`` of the sampled token (its sampler's ``log(probs)``
  before the top-p/top-k cut; greedy: the raw logits' log softmax). That is sharpen's behaviour logprob exactly when
  ``top_p`` is 1 and ``top_k`` 0 (the defaults); with a cut it lacks the renormalisation (it is lower by the log of the
  kept probability mass, which the trainer's truncated logprobs include), so the off-policy correction's ratio is off by
  that term. The engine warns once. (SGLang's ``return_sampling_mask`` reports the truncated policy's logprobs, but only
  with a finite top-k, which would change what is sampled.)
- Seeds: ``sampling_seed`` decides a request's sample only on a server started with
  --enable-deterministic-inference (``config.deterministic_inference``); otherwise SGLang ignores it. The engine
  warns once when it sends seeds to such a server.
- Finish reasons: ``{"type": "stop", "matched": ...}`` and ``{"type": "length", "length": n}`` map to "stop" and
  "length". ``{"type": "abort"}`` with a ``status_code`` arrives as that HTTP error (an `EngineError`); one
  without (an aborted request: /abort_request, a pause in abort mode) is sent again, up to `ABORT_RETRIES` times.
- Versions: a finished request's ``meta_info.weight_versions`` spans (``{"version", "start", "end"}`` over its
  output tokens) give each token's policy version, so a request that spans a weight update has tokens of two.
- Scoring: ``/generate`` with ``max_new_tokens`` 0, temperature 1, ``logprob_start_len`` 0: the prompt's
  ``meta_info.input_token_logprobs``, the first of which is ``[null, token, null]``.
- Weight sync: the tensors are written as a safetensors snapshot (`weight_files.write_safetensors`: shards of up to
  `SHARD_BYTES` and their index) into ``config.weights_dir`` (a folder the server reads at the same path: same host
  or shared storage; default: a temporary folder on this host), then ``POST /pause_generation`` (mode "retract":
  running requests go back to the queue, so the cache can be flushed, and are recomputed with the new weights
  afterwards), ``POST /update_weights_from_disk`` (``model_path`` the snapshot, ``load_format`` "safetensors",
  ``weight_version`` the policy version, ``flush_cache``), ``POST /continue_generation``, and the version is read
  back from /get_model_info. (A server too old for the ``mode`` field pauses in abort mode; its aborted requests are
  sent again.) The snapshot of the previous sync is deleted. (/update_weights_from_tensor and
  /update_weights_from_distributed need CUDA IPC handles or an NCCL group; a snapshot works for any server that can
  read the folder.)
- Sleep (``runtime.colocate``): ``/release_memory_occupation`` of the KV cache, weights and CUDA graphs, then
  ``/resume_memory_occupation`` of the weights on `wake_up` and of the rest after the next `load_weights`,
  which must replace every weight (SGLang keeps no copy unless started with --enable-weights-cpu-backup). Needs
  a server started with --enable-memory-saver and no request in flight. ``colocate/freed_bytes`` is the
  device-wide change this process sees (0 without CUDA).

Timeouts: generation and scoring give up after ``request_timeout_s``; information and pause routes after
`CONTROL_TIMEOUT_S`; weight and memory routes after `UPDATE_TIMEOUT_S`.

Restarts (`restart`, called by the router on a failed replica): a server sharpen started is killed (its process
group) and the same command started on the same port; a server at ``url`` is waited for until ``/health`` answers.
Then the engine connects as at the start (a server that still holds the engine's last snapshot passes the model
check) and reports version 0 until the next sync.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Coroutine, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from sharpen.config.engines import SglangEngineConfig
from sharpen.environments.tool_formats.decode import local_decoder
from sharpen.rollout.engines.base import EngineError, device_free_bytes
from sharpen.rollout.engines.server import ServerEngine
from sharpen.rollout.weight_sync.buckets import engine_sync_dtype
from sharpen.types import Completion, PolicyVersion, SamplingParams
from sharpen.weight_files import write_safetensors

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

T = TypeVar("T")

CONTROL_TIMEOUT_S = 60.0
"""Limit for the information, version and pause routes."""
UPDATE_TIMEOUT_S = 1800.0
"""Limit for loading a weight snapshot and for releasing or resuming memory."""
ABORT_RETRIES = 3
"""How often a request SGLang aborted (without an error status) is sent again."""
SHARD_BYTES = 1 << 30
"""Largest safetensors file of a weight snapshot."""
_MEMORY_TAGS = ["kv_cache", "weights", "cuda_graph"]
"""SGLang's memory regions (srt/constants.py); `sleep` releases all of them."""


def _sglang_installed() -> bool:
    return importlib.util.find_spec("sglang") is not None


class SglangEngine(ServerEngine[SglangEngineConfig]):
    name = "sglang engine"
    log_name = "sglang"
    launcher: tuple[str, ...] = ("-m", "sglang.launch_server")
    """What follows the Python interpreter in the command of a server sharpen starts."""

    def __init__(
        self,
        config: SglangEngineConfig,
        *,
        model_path: Path,
        dtype: str,
        seed: int,
        request_timeout_s: float | None = None,
        log_dir: Path | None = None,
    ) -> None:
        super().__init__(config)
        self.model_path = model_path
        self.decode = local_decoder(model_path)
        """The completion's text from its ids keeping the tool-call markers (the server's text has no special
        token); None without the model's folder here."""
        self.dtype = dtype
        self.server_version: str | None = None
        """SGLang's version, as /get_server_info reports it."""
        self.is_asleep = False
        self._memory_released = False  # woken weights, KV cache and CUDA graphs still released
        self._memory_saver: bool | None = None
        self._deterministic: bool | None = None
        self._warned_top_p = False
        self._warned_seed = False
        self._weights_root: Path | None = None
        self._own_weights_root = False
        self._snapshot: Path | None = None
        self._open(model_path=model_path, dtype=dtype, seed=seed, request_timeout_s=request_timeout_s, log_dir=log_dir)

    # --- starting and connecting -----------------------------------------------------------------------------

    def _server_command(self, *, port: int, model_path: Path, dtype: str, seed: int) -> list[str]:
        if not _sglang_installed():
            raise EngineError(
                f"{self.name}: starting an SGLang server needs the `sglang` package, which is not installed in this "
                "environment (it runs on CUDA machines); install it, or set rollout.engine.url to a running SGLang "
                "server (python -m sglang.launch_server)"
            )
        config = self.config
        command = [
            sys.executable,
            *self.launcher,
            "--model-path",
            str(model_path),
            "--host",
            config.host,
            "--port",
            str(port),
            "--dtype",
            dtype,
            "--random-seed",
            str(seed),
            "--tp-size",
            str(config.tensor_parallel_size),
            "--weight-version",
            "0",
        ]
        if config.mem_fraction_static is not None:
            command += ["--mem-fraction-static", str(config.mem_fraction_static)]
        if config.served_model_name is not None:
            command += ["--served-model-name", config.served_model_name]
        if config.enable_memory_saver:
            command.append("--enable-memory-saver")
        if config.deterministic_inference:
            command.append("--enable-deterministic-inference")
        return command + config.extra_args

    def _forget_server_state(self) -> None:
        self.is_asleep = self._memory_released = False

    def _connect(self) -> None:
        """Check that the server is SGLang serving this run's model, and set its weight version to 0."""
        try:
            info = self._control("GET", "/get_model_info")
        except EngineError as error:
            raise EngineError(
                f"{self.name}: {self.url} does not answer as an SGLang server would (GET /get_model_info): {error}"
            ) from None
        if not isinstance(info, dict) or not isinstance(info.get("model_path"), str):
            raise EngineError(
                f"{self.name}: {self.url} is not an SGLang server: GET /get_model_info gave "
                f"{_describe(info)}, not SGLang's model information (model_path, is_generation, ...)"
            )
        reported = [info["model_path"], *([info["served_model_name"]] if info.get("served_model_name") else [])]
        if not self._serves_this_model(reported):
            expected = self.config.served_model_name or str(self.model_path)
            raise EngineError(
                f"{self.name}: {self.url} serves {info['model_path']!r} (served model name "
                f"{info.get('served_model_name')!r}), not this run's model {expected!r}; connect to a server of this "
                "model, or set rollout.engine.served_model_name to the name the server reports if it is the same one"
            )
        if info.get("is_generation") is False:
            raise EngineError(f"{self.name}: {self.url} serves {info['model_path']!r} as an embedding/reward model")
        server_info = self._control("GET", "/get_server_info")
        if isinstance(server_info, dict):
            version = server_info.get("version")
            self.server_version = str(version) if version is not None else None
            saver = server_info.get("enable_memory_saver")
            self._memory_saver = saver if isinstance(saver, bool) else None
            deterministic = server_info.get("enable_deterministic_inference")
            self._deterministic = deterministic if isinstance(deterministic, bool) else None
        if "weight_version" in info and info["weight_version"] != str(self.policy_version):
            self._control(
                "POST",
                "/update_weight_version",
                {"new_version": str(self.policy_version), "abort_all_requests": False},
            )

    def _serves_this_model(self, reported: list[str]) -> bool:
        snapshot = self._snapshot
        if snapshot is not None and any(_same_path(name, snapshot) for name in reported):
            return True  # it holds this engine's last weight sync (a server at a URL, connected again)
        if self.config.served_model_name is not None:
            return self.config.served_model_name in reported
        expected = str(self.model_path)
        return any(name == expected or _same_path(name, self.model_path) for name in reported)

    # --- requests ----------------------------------------------------------------------------------------------

    def _run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        return self._loop.run(coroutine)

    def _control(self, method: str, path: str, body: Any = None, *, timeout_s: float = CONTROL_TIMEOUT_S) -> Any:
        return self._run(self.client.request(method, path, json=body, timeout_s=timeout_s))

    def _check_awake(self, call: str) -> None:
        if self.is_asleep:
            raise EngineError(f"{self.name}: {call}() while asleep (call wake_up() and load_weights() first)")
        if self._memory_released:
            raise EngineError(f"{self.name}: {call}() after wake_up() before load_weights() replaced the weights")

    def _sampling_params(self, params: SamplingParams) -> dict[str, Any]:
        sampling: dict[str, Any] = {
            "max_new_tokens": params.max_new_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
        }
        if params.top_k > 0:
            sampling["top_k"] = params.top_k
        if params.stop_token_ids:
            sampling["stop_token_ids"] = list(params.stop_token_ids)
        if params.seed is not None:
            sampling["sampling_seed"] = params.seed
            if self._deterministic is False and not self._warned_seed:
                self._warned_seed = True
                logger.warning(
                    "%s: %s was started without --enable-deterministic-inference, so SGLang ignores each request's "
                    "seed (rollout.engine.deterministic_inference for a server sharpen starts)",
                    self.name,
                    self.url,
                )
        if (params.top_p < 1.0 or params.top_k > 0) and params.temperature > 0 and not self._warned_top_p:
            self._warned_top_p = True
            logger.warning(
                "%s: with top_p = %g / top_k = %d SGLang's logprobs are the temperature-scaled distribution's before "
                "the cut, not the truncated behaviour policy's the trainer scores (the importance ratio is off by the "
                "kept mass)",
                self.name,
                params.top_p,
                params.top_k,
            )
        return sampling

    async def _post_generate(self, body: dict[str, Any], timeout_s: float | None = -1.0) -> dict[str, Any]:
        """The answer to ``body``, sent again when SGLang aborted it without an error status."""
        reason: Any = None
        for attempt in range(ABORT_RETRIES + 1):
            answer = await self.client.post("/generate", body, timeout_s=timeout_s)
            meta = answer.get("meta_info") if isinstance(answer, dict) else None
            if not isinstance(meta, dict):
                raise EngineError(f"{self.name}: POST {self.url}/generate gave {_describe(answer)}, no meta_info")
            reason = meta.get("finish_reason")
            if not (isinstance(reason, dict) and reason.get("type") == "abort"):
                return answer
            if attempt < ABORT_RETRIES:
                logger.warning("%s: SGLang aborted a request (%s); sending it again", self.name, reason.get("message"))
        raise EngineError(
            f"{self.name}: {self.url} aborted a request {ABORT_RETRIES + 1} times "
            f"(last: {reason.get('message')!r}); is something aborting requests or pausing it in abort mode?"
        )

    async def _generate_one(self, prompt: list[int], params: SamplingParams) -> Completion:
        self._check_awake("generate")
        sent_version = self.policy_version
        body = {"input_ids": prompt, "sampling_params": self._sampling_params(params), "return_logprob": True}
        answer = await self._post_generate(body)
        meta = answer["meta_info"]
        entries = meta.get("output_token_logprobs")
        token_ids = answer.get("output_ids")
        if not isinstance(entries, list) or not isinstance(token_ids, list) or len(entries) != len(token_ids):
            raise EngineError(
                f"{self.name}: {self.url}/generate gave {len(token_ids or [])} output ids and "
                f"{len(entries or [])} output logprobs"
            )
        logprobs = [_logprob(entry, self.name) for entry in entries]
        reason = meta.get("finish_reason")
        kind = reason.get("type") if isinstance(reason, dict) else None
        if kind not in ("stop", "length"):
            raise EngineError(f"{self.name}: {self.url}/generate finished with {reason!r}")
        ids = [int(token) for token in token_ids]
        return Completion(
            token_ids=ids,
            logprobs=logprobs,
            text=str(answer.get("text") or "") if self.decode is None else self.decode(ids),
            finish_reason="length" if kind == "length" else "stop",
            versions=self._versions(meta, len(token_ids), sent_version),
        )

    def _versions(self, meta: dict[str, Any], num: int, sent_version: PolicyVersion) -> list[PolicyVersion]:
        """Each token's policy version from the ``weight_versions`` spans (or the one ``weight_version``; without
        either, the engine's version when the request was sent)."""
        versions: list[PolicyVersion | None] = [None] * num
        spans = meta.get("weight_versions") or []
        for span in spans if isinstance(spans, list) else []:
            if not (isinstance(span, dict) and isinstance(span.get("start"), int) and isinstance(span.get("end"), int)):
                raise EngineError(f"{self.name}: {self.url}/generate gave a malformed weight_versions span {span!r}")
            version = self._parse_version(span.get("version"))
            for position in range(max(span["start"], 0), min(span["end"], num)):
                versions[position] = version
        if all(version is not None for version in versions):
            return [version for version in versions if version is not None]
        if meta.get("weight_version") is not None:
            return [self._parse_version(meta["weight_version"])] * num
        return [sent_version] * num

    def _parse_version(self, version: object) -> PolicyVersion:
        try:
            return int(str(version))
        except ValueError:
            raise EngineError(
                f"{self.name}: {self.url} reports weight version {version!r}, not a policy version sharpen set "
                "(has another client updated its weights?)"
            ) from None

    def score(self, token_ids: list[int]) -> list[float]:
        self._check_awake("score")
        body = {
            "input_ids": token_ids,
            "sampling_params": {"max_new_tokens": 0, "temperature": 1.0},
            "return_logprob": True,
            "logprob_start_len": 0,
        }
        answer = self._run(self._post_generate(body))
        entries = answer["meta_info"].get("input_token_logprobs")
        if not isinstance(entries, list) or len(entries) != len(token_ids):
            raise EngineError(
                f"{self.name}: {self.url}/generate gave {len(entries or [])} input logprobs for {len(token_ids)} tokens"
            )
        return [_logprob(entry, self.name) for entry in entries[1:]]

    # --- weights -----------------------------------------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], *, version: PolicyVersion) -> dict[str, float]:
        """Write ``weights`` as a safetensors snapshot, load it into the server while generation is paused, and
        check the version it reports; a refusal is an `EngineError` (generation continues on the old weights)."""
        if self.is_asleep:
            raise EngineError(f"{self.name}: load_weights() while asleep (call wake_up() first)")
        started = time.perf_counter()
        folder = self._weights_folder() / f"v{version}-{uuid.uuid4().hex[:8]}"
        try:
            snapshot = write_safetensors(
                weights, folder, max_shard_bytes=SHARD_BYTES, dtype=engine_sync_dtype(self.dtype)
            )
            if not snapshot.num_tensors:
                raise EngineError(f"{self.name}: load_weights() got no tensors")
        except ValueError as error:  # a weight given twice
            shutil.rmtree(folder, ignore_errors=True)
            raise EngineError(f"{self.name}: {error}") from None
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        written = time.perf_counter()
        body = {
            "model_path": str(folder),
            "load_format": "safetensors",
            "abort_all_requests": False,
            "weight_version": str(version),
            "flush_cache": not self._memory_released,  # releasing the KV cache flushed it
        }
        paused = loaded = written
        try:
            self._control("POST", "/pause_generation", {"mode": "retract"})
            paused = time.perf_counter()
            self._control("POST", "/update_weights_from_disk", body, timeout_s=UPDATE_TIMEOUT_S)
            loaded = time.perf_counter()
            if self._memory_released:  # the weights are in: the KV cache (and CUDA graphs) may come back
                tags = {"tags": ["kv_cache", "cuda_graph"]}
                self._control("POST", "/resume_memory_occupation", tags, timeout_s=UPDATE_TIMEOUT_S)
                self._memory_released = False
        except EngineError as error:
            shutil.rmtree(folder, ignore_errors=True)
            with contextlib.suppress(EngineError):
                self._control("POST", "/continue_generation", {})
            raise EngineError(f"{self.name}: the server did not load weights version {version}: {error}") from None
        self._control("POST", "/continue_generation", {})
        continued = time.perf_counter()
        info = self._control("GET", "/get_model_info")
        reported = info.get("weight_version", str(version)) if isinstance(info, dict) else None
        if reported != str(version):
            raise EngineError(
                f"{self.name}: after loading weights version {version} the server reports weight version {reported!r}"
            )
        if self._snapshot is not None:
            shutil.rmtree(self._snapshot, ignore_errors=True)
        self._snapshot = folder
        self.policy_version = version
        return {
            "sync/seconds": time.perf_counter() - started,
            "sync/snapshot_seconds": written - started,
            "sync/load_seconds": loaded - paused,
            "sync/paused_seconds": continued - written,
            "sync/bytes": float(snapshot.num_bytes),
            "sync/num_tensors": float(snapshot.num_tensors),
        }

    def _weights_folder(self) -> Path:
        if self._weights_root is None:
            if self.config.weights_dir is not None:
                self._weights_root = Path(self.config.weights_dir)
                self._weights_root.mkdir(parents=True, exist_ok=True)
            else:
                self._weights_root = Path(tempfile.mkdtemp(prefix="sharpen-sglang-weights-"))
                self._own_weights_root = True
        return self._weights_root

    # --- sleep -------------------------------------------------------------------------------------------------

    def sleep(self) -> dict[str, float]:
        """Release the KV cache, weights and CUDA graphs (no request may be in flight)."""
        if self.is_asleep:
            return {"colocate/freed_bytes": 0.0}
        if self._memory_saver is False:
            raise EngineError(
                f"{self.name}: {self.url} was started without --enable-memory-saver, so it cannot give its memory "
                "back (rollout.engine.enable_memory_saver for a server sharpen starts)"
            )
        before = device_free_bytes()
        self._control("POST", "/release_memory_occupation", {"tags": _MEMORY_TAGS}, timeout_s=UPDATE_TIMEOUT_S)
        self.is_asleep = True
        self._memory_released = True
        return {"colocate/freed_bytes": float(max(device_free_bytes() - before, 0))}

    def wake_up(self) -> dict[str, float]:
        """Take back the weights' memory; the KV cache and CUDA graphs follow the next `load_weights`."""
        if self.is_asleep:
            self._control("POST", "/resume_memory_occupation", {"tags": ["weights"]}, timeout_s=UPDATE_TIMEOUT_S)
            self.is_asleep = False
        return {}

    # --- closing -----------------------------------------------------------------------------------------------

    def close(self) -> None:
        """Close the connections, stop a server sharpen started and delete the snapshots it wrote."""
        try:
            super().close()
        finally:
            if self._snapshot is not None:
                shutil.rmtree(self._snapshot, ignore_errors=True)
            if self._own_weights_root and self._weights_root is not None:
                shutil.rmtree(self._weights_root, ignore_errors=True)


def _logprob(entry: object, name: str) -> float:
    if not isinstance(entry, list) or not entry or not isinstance(entry[0], int | float):
        raise EngineError(f"{name}: expected a [logprob, token_id, text] entry, got {entry!r}")
    return float(entry[0])


def _describe(value: object) -> str:
    if isinstance(value, dict):
        return f"a JSON object with keys {sorted(value)[:12]}"
    return f"{type(value).__name__} {str(value)[:200]!r}"


def _same_path(name: str, path: Path) -> bool:
    try:
        return Path(name).resolve() == path.resolve()
    except (OSError, ValueError):
        return False
