"""Environments of the `verifiers` package (0.4, its ``verifiers.v1`` stack) as sharpen `AgentEnvironment`s.

A verifiers environment is a taskset (rows, each a `Task` whose ``@vf.reward`` methods score a finished trace),
optionally paired with an `Env` that says how its agents play a task (one seat, or several turn by turn). Each seat
runs a harness: a program that calls the model through verifiers' interception server, which relays every call to
the run's model endpoint. This adapter runs one verifiers episode per sharpen episode with verifiers' own code
(``Env.run_episode``), its model endpoint being the episode's `AgentClient`, so each call reaches sharpen's agent
endpoint (which records its tokens), and reports the episode's rewards. It parses, renders and tokenises nothing.

What it decides on verifiers' behalf, and why:

- Seats that pin no runtime run in verifiers' ``subprocess`` runtime (verifiers defaults to a hosted sandbox
  service). Seats that pin no harness, of tasksets that bundle none, run ``harness`` (default ``null``: verifiers'
  plain chat loop with the task's MCP tools; verifiers' own default, ``bash``, runs model-written shell commands on
  this host). Each seat's ``max_turns`` is the episode's, so verifiers ends a long episode itself and still scores it.
- verifiers prepares its chat program (the ``null`` and ``bash`` harnesses) as a PEP 723 script in an environment
  that uv builds at run time, downloading uv and the script's packages. The ``agents`` extra installs those packages
  here, so the subprocess runtime runs the same program with this interpreter instead (as verifiers runs its
  subprocess tool servers): nothing is downloaded.
- verifiers reads an endpoint's key from an environment variable, so the episode's key is put in one of its own for
  the episode (its name contains ``API_KEY``, which the subprocess runtime withholds from the programs it starts).

A verifiers episode that fails (a harness, tool or scoring error) raises `EnvironmentInfraError`. The rows become
sharpen `Example`s (`make_tasks`) carrying the task's data, from which `run_agent` rebuilds the task, as verifiers'
own replay does.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import os
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from sharpen.environments.base import AgentClient, AgentResult, EnvironmentInfraError, EpisodeContext
from sharpen.plugins import PluginLoadError, load_object
from sharpen.types import Example, Message

INSTALL_HINT = "pip install 'sharpen[agents]'"
_TASK_KEY = "verifiers_task"
"""Where an `Example` made here carries its task's data (``TaskData.model_dump(mode="json")``)."""


def import_verifiers() -> Any:
    """``verifiers.v1``, or one error that names the extra to install."""
    try:
        import verifiers.v1 as vf
    except ImportError as error:
        raise PluginLoadError(
            f'environment.type = "verifiers" needs the verifiers package, which cannot be imported ({error}): '
            f"{INSTALL_HINT}"
        ) from error
    return vf


class VerifiersEnvironment:
    """One episode of a verifiers environment, named by its taskset id (``taskset``, loaded through verifiers'
    ``load_environment`` with ``env_config`` as the rest of its ``[env]`` block) or built by ``factory``
    (``module:function`` or ``path/file.py:function`` returning a verifiers ``Env``, called with ``kwargs``)."""

    name = "verifiers"
    version = "1"

    def __init__(
        self,
        *,
        taskset: str = "",
        env_config: dict[str, Any] | None = None,
        factory: str | None = None,
        kwargs: dict[str, Any] | None = None,
        harness: str | None = "null",
    ) -> None:
        if bool(taskset) == bool(factory):
            raise ValueError("a verifiers environment needs exactly one of taskset and factory")
        self.taskset = taskset
        self.env_config = dict(env_config or {})
        self.factory = factory
        self.kwargs = dict(kwargs or {})
        self.harness = harness

    def load(self, *, max_turns: int | None = None) -> Any:
        """A fresh verifiers ``Env`` (one per episode: its serving resources are per instance)."""
        vf = import_verifiers()
        _run_chat_program_with_this_interpreter()
        if self.factory is not None:
            env = load_object(self.factory, what="environment.factory")(**self.kwargs)
            if not isinstance(env, vf.Env):
                raise PluginLoadError(
                    f"environment.factory = {self.factory!r} returned a {type(env).__name__}, not a verifiers Env"
                )
            return env
        try:
            return vf.load_environment(self._env_config(vf, max_turns=max_turns))
        except (ImportError, TypeError, AttributeError, ValueError) as error:  # verifiers' words for a bad [env]
            raise PluginLoadError(f"environment.taskset = {self.taskset!r}: {error}") from error

    def make_tasks(self, num_tasks: int) -> list[Example]:
        """The first ``num_tasks`` rows of the taskset (all of them if it has fewer), in its order; the run's sampler
        shuffles them."""
        env = self.load()
        env_id = env.config.env_id
        return [_example(task, env_id) for task in env.taskset.take(num_tasks)]

    async def run_agent(self, example: Example, ctx: EpisodeContext, client: AgentClient) -> AgentResult:
        vf = import_verifiers()
        if _TASK_KEY not in example.metadata:
            raise ValueError(
                f"example {example.task_key!r} was not made by a verifiers taskset (data.type = environment)"
            )
        env = self.load(max_turns=ctx.max_turns)
        task_type = type(env.taskset).task_type()
        task = task_type(task_type.data_type().model_validate(example.metadata[_TASK_KEY]), env.taskset.config.task)
        with _key_variable(client.api_key) as variable:
            endpoint = vf.EvalClientConfig(base_url=client.base_url, api_key_var=variable)
            async with env.serving():
                episode = await env.run_episode(task, vf.ModelContext(model=client.model, client=endpoint))
        return _agent_result(episode)

    def _env_config(self, vf: Any, *, max_turns: int | None) -> Any:
        """The ``[env]`` block: ``env_config`` with the taskset id, and the defaults above for every seat."""
        data = copy.deepcopy(self.env_config)
        data["taskset"] = {**data.get("taskset", {}), "id": self.taskset}
        config_type = vf.env_config_type(self.taskset, data.get("id", ""))
        bundles_harness = vf.default_harness_id(self.taskset) == self.taskset
        for role, field in config_type.model_fields.items():
            declared = field.default
            if not isinstance(declared, vf.AgentConfig):
                continue
            seat = dict(data.get(role) or {})
            if "runtime" not in declared.model_fields_set:
                seat.setdefault("runtime", {"type": "subprocess"})
            if self.harness is not None and declared.harness is None and not bundles_harness:
                seat.setdefault("harness", {"id": self.harness})
            if max_turns is not None and declared.max_turns is None:
                seat.setdefault("max_turns", max_turns)
            data[role] = seat
        return vf.resolve_env_config(data)


def _example(task: Any, env_id: str) -> Example:
    data = task.data
    prompt: list[Message] = []
    if data.system_prompt:
        prompt.append(Message(role="system", content=data.system_prompt))
    if isinstance(data.prompt, str):
        prompt.append(Message(role="user", content=data.prompt))
    else:
        from verifiers.v1.types import content_text

        prompt += [Message(role=m.role, content=content_text(m.content) or "") for m in data.prompt or []]
    answer = getattr(data, "answer", None)
    return Example(
        task_key=f"{env_id}/{task.key}",
        prompt=tuple(prompt),
        answer=None if answer is None else str(answer),
        metadata={"source": "verifiers", _TASK_KEY: data.model_dump(mode="json")},
    )


def _agent_result(episode: Any) -> AgentResult:
    if not episode.ok:
        errors = [*episode.errors, *(e for trace in episode.traces for e in trace.errors)]
        cause = f"{errors[-1].type}: {errors[-1].message}" if errors else "no error recorded"
        raise EnvironmentInfraError(f"the verifiers episode failed ({cause})")
    traces = [t for t in episode.traces if t.agent is None or t.agent.trainable] or list(episode.traces)
    last = traces[-1]
    return AgentResult(
        reward=sum(t.reward for t in traces) / len(traces),
        is_truncated=any(t.is_truncated or t.is_timeout for t in traces),
        stop_reason=last.stop_condition or "terminated",
        info={
            "rewards": {name: r.score for t in traces for name, r in t.rewards.items() if r is not None},
            "reward_weights": {name: r.weight for t in traces for name, r in t.rewards.items() if r is not None},
            "metrics": {name: value for t in traces for name, value in t.metrics.items()},
            "num_model_calls": sum(t.num_turns for t in traces),
        },
    )


@contextlib.contextmanager
def _key_variable(api_key: str) -> Iterator[str]:
    variable = f"SHARPEN_AGENT_API_KEY_{uuid.uuid4().hex}"
    os.environ[variable] = api_key
    try:
        yield variable
    finally:
        os.environ.pop(variable, None)


_chat_program_is_prepared = False


def _run_chat_program_with_this_interpreter() -> None:
    """Prepare verifiers' chat program (of its ``null`` and ``bash`` harnesses) for its subprocess runtime as the
    runtime itself would, with this interpreter in place of the one uv would build (see the module docstring).

    The runtime keys prepared scripts by the sha256 of their source under its scripts folder and keeps each
    script's interpreter in a class-level cache: this writes the script there and fills that cache entry."""
    global _chat_program_is_prepared
    if _chat_program_is_prepared:
        return
    from verifiers.v1.harnesses.utils.launch import CHAT_PROGRAM_SOURCE
    from verifiers.v1.runtimes.subprocess import SubprocessRuntime

    source = CHAT_PROGRAM_SOURCE.encode()
    path = Path(SubprocessRuntime.scripts_dir) / f"{hashlib.sha256(source).hexdigest()}.py"
    if not path.is_file() or path.read_bytes() != source:
        path.parent.mkdir(parents=True, exist_ok=True)
        staged = path.with_name(f"{path.name}.{uuid.uuid4().hex}.tmp")
        staged.write_bytes(source)
        staged.replace(path)  # atomic: another process preparing it at the same time writes the same bytes
    SubprocessRuntime._interpreters[str(path)] = sys.executable
    _chat_program_is_prepared = True
