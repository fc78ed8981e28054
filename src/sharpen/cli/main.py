"""`sharpen train | eval | config | inspect | dashboard | replay | serve-rm | serve-sandbox | serve-env | simulate |
models | tasks`: the entry point.

Start-up imports only argparse, pydantic and the config schemas, so `sharpen --help` and config errors answer
in well under a second. User errors (bad recipe, missing model, bad data) print one line and exit 2.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import time
import warnings
from collections.abc import Sequence
from pathlib import Path

from pydantic import ValidationError

from sharpen.cli.tasks import add_tasks_parser, run_tasks_command
from sharpen.config import ConfigError, SharpenConfig, dump_config, load_config
from sharpen.config.evaluation import EvalConfig
from sharpen.config.loader import format_validation_error
from sharpen.config.models import KNOWN_MODELS, ModelNotFoundError
from sharpen.config.section import DeprecatedKeyWarning

EXIT_USER_ERROR = 2


def _add_recipe_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", nargs="?", help="TOML recipe (omit to start from the defaults)")
    parser.add_argument(
        "overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides, e.g. trainer.learning_rate=1e-5"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sharpen", description="RL post-training of language models.")
    commands = parser.add_subparsers(dest="command", required=True)

    train = commands.add_parser("train", help="run a recipe: generate, score, train, sync, repeat")
    _add_recipe_arguments(train)
    train.add_argument(
        "--resume",
        nargs="?",
        const=True,
        default=False,
        type=_resume_value,
        metavar="auto",
        help="continue the run in its run directory from its newest complete checkpoint; with 'auto', continue "
        "when there is one and start from step 0 otherwise (one command for a job that may be restarted)",
    )
    train.add_argument(
        "--verbose",
        action="store_true",
        help="also show vLLM's, Ray's and other libraries' output here (it always goes to run_dir/sharpen.log)",
    )

    evaluation = commands.add_parser(
        "eval", help="sample a recipe's model (model.path) on its tasks and report pass@k, maj@k and mean@k"
    )
    _add_recipe_arguments(evaluation)
    evaluation.add_argument("--num-samples", type=int, default=None, metavar="N", help="samples per task")
    evaluation.add_argument(
        "--ks", default=None, metavar="K,K", help="comma-separated k values, e.g. 1,5 (each at most --num-samples)"
    )
    evaluation.add_argument("--num-tasks", type=int, default=None, metavar="N", help="evaluate the first N tasks")
    evaluation.add_argument(
        "--output", default=None, metavar="FILE.json", help="where to write the report (default: run_dir/eval.json)"
    )
    evaluation.add_argument(
        "--verbose",
        action="store_true",
        help="also show vLLM's and other libraries' output here (it always goes to a .log beside the report)",
    )

    config = commands.add_parser("config", help="print the resolved config of a recipe (or every key with its help)")
    _add_recipe_arguments(config)
    config.add_argument("--keys", action="store_true", help="list every config key with its type, default and help")

    inspect = commands.add_parser("inspect", help="a run's health: progress, reward trend, time per phase, warnings")
    inspect.add_argument("run_dir", help="a run directory (holds metrics.jsonl)")

    replay = commands.add_parser(
        "replay", help="re-run a recorded episode's environment side and check that it reproduces"
    )
    replay.add_argument("run_dir", help="a run directory (holds config.toml and rollouts.jsonl)")
    replay.add_argument("--step", type=int, default=None, help="the recorded step (default: the last one)")
    replay.add_argument("--index", type=int, default=0, help="which recorded rollout of that step (default: 0)")

    serve_rm = commands.add_parser(
        "serve-rm",
        help="serve a sequence-classification reward model over HTTP (POST /score; token in $SHARPEN_SERVICE_TOKEN; "
        "/healthz, /readyz, /metrics)",
    )
    serve_rm.add_argument("model_path", help="a local folder with the reward model (num_labels=1) and its tokenizer")
    serve_rm.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    serve_rm.add_argument("--port", type=int, default=8000, help="port to listen on (0 picks a free one)")
    serve_rm.add_argument("--max-batch-size", type=int, default=32, help="most inputs in one forward")
    serve_rm.add_argument(
        "--max-wait-ms", type=float, default=5.0, help="how long the batcher waits for more requests to batch"
    )
    serve_rm.add_argument("--max-length", type=int, default=1024, help="inputs are cut to their last N tokens")

    for name, what in (("serve-sandbox", "the recipe's [sandbox]"), ("serve-env", "the recipe's [environment]")):
        serve = commands.add_parser(
            name, help=f"serve {what} over HTTP (token in $SHARPEN_SERVICE_TOKEN; /healthz, /readyz, /metrics)"
        )
        _add_recipe_arguments(serve)
        serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
        serve.add_argument("--port", type=int, default=8100, help="port to listen on (0 picks a free one)")

    simulate = commands.add_parser(
        "simulate", help="simulate a cluster scenario: step time, GPU use per role, async speedup, best GPU split"
    )
    simulate.add_argument("scenario", help="a scenario TOML (see scenarios/ and docs/scaling.md)")
    simulate.add_argument("--json", action="store_true", help="print the report as JSON")
    simulate.add_argument(
        "--search-split",
        type=int,
        default=None,
        metavar="BUDGET_GPUS",
        help="also simulate engine/trainer splits of this many GPUs (at most 25) and name the fastest",
    )
    simulate.add_argument(
        "--search-layout",
        action="store_true",
        help="also price every trainer layout (tp, pp, cp) of the trainer's GPUs and name the fastest that fits",
    )

    dashboard = commands.add_parser(
        "dashboard", help="a local web page of runs: metric curves, rollouts coloured per token, eval results"
    )
    dashboard.add_argument("runs_dir", help="a folder of run directories (each holds metrics.jsonl)")
    dashboard.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    dashboard.add_argument("--port", type=int, default=8765, help="port to listen on (0 picks a free one)")
    dashboard.add_argument(
        "--allow-host",
        action="append",
        default=[],
        metavar="NAME",
        help="a DNS name the page may be reached by, beside IP addresses and localhost (repeatable; other Host "
        "headers are refused, against DNS rebinding)",
    )

    models = commands.add_parser("models", help="manage known models: shipped in Python packages or built here")
    model_commands = models.add_subparsers(dest="models_command", required=True)
    pull = model_commands.add_parser("pull", help="convert (or build) a known model once into the local cache")
    pull.add_argument("name", choices=sorted(KNOWN_MODELS))
    pull.add_argument("--force", action="store_true", help="convert again even if cached")
    model_commands.add_parser("list", help="known models and where they are cached")
    add_tasks_parser(commands)
    return parser


def _resume_value(text: str) -> str:
    if text != "auto":
        raise argparse.ArgumentTypeError(f"expected nothing or 'auto', not {text!r}")
    return text


def _resume_last(argv: list[str]) -> list[str]:
    """``--resume`` (with its ``auto``, if given) moved to the end: argparse would otherwise take the recipe after a
    bare ``--resume`` for its value, and stop reading overrides after ``--resume auto``."""
    for index, arg in enumerate(argv):
        if arg == "--resume":
            size = 2 if argv[index + 1 : index + 2] == ["auto"] else 1
            return [*argv[:index], *argv[index + size :], *argv[index : index + size]]
    return argv


def _split_overrides(recipe: str | None, overrides: list[str]) -> tuple[str | None, list[str]]:
    """argparse puts a first KEY=VALUE into ``recipe`` when no recipe is given."""
    if recipe is not None and "=" in recipe and not recipe.endswith(".toml"):
        return None, [recipe, *overrides]
    return recipe, overrides


def _run(args: argparse.Namespace) -> int:
    if args.command == "models":
        from sharpen.cli import models

        if args.models_command == "list":
            for name in KNOWN_MODELS:
                folder = models.cached_model_dir(name)
                print(f"{name}\t{'pulled' if models.is_model_folder(folder) else 'not pulled'}\t{folder}")
            return 0
        print(models.pull_model(args.name, force=args.force))
        return 0

    if args.command == "tasks":
        return run_tasks_command(args)
    if args.command == "replay":
        return _replay(args)
    if args.command == "inspect":
        from sharpen.monitoring.inspect import inspect_run

        try:
            print(inspect_run(Path(args.run_dir)).to_text())
        except ValueError as error:
            raise ConfigError(str(error)) from None
        return 0
    if args.command == "serve-rm":
        return _serve_rm(args)
    if args.command == "simulate":
        return _simulate(args)
    if args.command == "dashboard":
        return _dashboard(args)
    recipe, overrides = _split_overrides(args.recipe, args.overrides)
    if args.command == "config":
        if args.keys:
            from sharpen.cli.keys import describe_keys

            print(describe_keys())
            return 0
        print(dump_config(load_config(recipe, overrides)), end="")
        return 0

    config = load_config(recipe, overrides)
    if args.command in ("serve-sandbox", "serve-env"):
        from sharpen.cli.serve import serve_environment, serve_sandbox

        if args.command == "serve-env" and recipe is None:
            raise ConfigError("serve-env needs a recipe: its [environment] section says what to serve")
        serve = serve_sandbox if args.command == "serve-sandbox" else serve_environment
        return serve(config, host=args.host, port=args.port)
    if args.command == "eval":
        return _eval(config, args)
    return _train(config, args)


def _train(config: SharpenConfig, args: argparse.Namespace) -> int:
    """Run the recipe with only sharpen's own lines on the terminal; the libraries' output goes to the run's log,
    which is set up here, before the run directory's other contents (the run decides whether it may use it)."""
    from sharpen.monitoring.run_log import LOG_FILE_NAME, capture_run_output
    from sharpen.orchestration.runtime import run

    log_path = Path(config.run.output_dir) / config.run.name / LOG_FILE_NAME
    with capture_run_output(log_path, verbose=args.verbose, is_refusal=_is_user_error) as terminal:
        if not args.verbose:
            terminal.print_line(f"libraries' output (vLLM, Ray, transformers, warnings): {log_path}")
        run_dir = run(config, resume=args.resume)
    print(f"run directory: {run_dir}")
    _print_doctor(run_dir)
    return 0


def _print_doctor(run_dir: Path) -> None:
    """The run doctor's warnings about a finished run (`monitoring.inspect`), one line each on stderr."""
    from sharpen.monitoring.inspect import inspect_run

    try:
        warnings = inspect_run(run_dir).warnings
    except ValueError:  # no steps recorded
        return
    for warning in warnings:
        print(f"sharpen: warning: {warning}", file=sys.stderr)


def _eval_config(config: SharpenConfig, args: argparse.Namespace) -> EvalConfig:
    """The recipe's evaluation section with the command line's flags applied (validated together: ks <=
    num_samples)."""
    settings = config.evaluation.model_dump()
    if args.num_samples is not None:
        settings["num_samples"] = args.num_samples
    if args.num_tasks is not None:
        settings["num_tasks"] = args.num_tasks
    if args.ks is not None:
        try:
            settings["ks"] = [int(k) for k in args.ks.split(",")]
        except ValueError:
            raise ConfigError(f"--ks {args.ks!r}: expected comma-separated integers, e.g. --ks 1,5") from None
    try:
        return EvalConfig.model_validate(settings)
    except ValidationError as error:
        raise ConfigError(format_validation_error(error).replace("\n", "; ")) from None


def _eval(config: SharpenConfig, args: argparse.Namespace) -> int:
    eval_config = _eval_config(config, args)
    output = Path(args.output) if args.output else Path(config.run.output_dir) / config.run.name / "eval.json"
    from sharpen.monitoring.run_log import capture_run_output
    from sharpen.orchestration.evaluate import run_eval

    log_path = output.with_suffix(".log")
    with capture_run_output(log_path, verbose=args.verbose, is_refusal=_is_user_error) as terminal:
        if not args.verbose:
            terminal.print_line(f"libraries' output (vLLM, transformers, warnings): {log_path}")
        report = run_eval(config, eval_config)
    if sys.stdout.isatty():
        from rich.console import Console

        Console().print(report.to_rich())
    else:
        print(report.to_text())
    print(report.summary_line())
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(report.to_json())
    print(f"report: {output}")
    return 0


def _replay(args: argparse.Namespace) -> int:
    from sharpen.orchestration.replay import replay_recorded

    record, report = replay_recorded(Path(args.run_dir), step=args.step, index=args.index)
    episode = record["episode"]
    where = f"step {record['step']} task {record['task_key']} sample {record['sample_index']}"
    print(f"{where}: environment {episode['environment']} v{episode['environment_version']}, seed {episode['seed']}")
    if report.is_reproduced:
        print(f"reproduced: {report.num_turns} turns, same observations, rewards and end flags")
        return 0
    print("NOT reproduced:")
    for difference in report.differences:
        print(f"  {difference}")
    return 1


def _serve_rm(args: argparse.Namespace) -> int:
    from sharpen.cli.serve import serve_reward_model

    return serve_reward_model(
        Path(args.model_path),
        host=args.host,
        port=args.port,
        max_batch_size=args.max_batch_size,
        max_wait_ms=args.max_wait_ms,
        max_length=args.max_length,
    )


def _simulate(args: argparse.Namespace) -> int:
    from sharpen.simulation import build_report, load_scenario

    started = time.monotonic()

    def progress(line: str) -> None:  # on stderr, so `--json > file` stays clean
        print(f"sharpen simulate: {time.monotonic() - started:6.1f} s  {line}", file=sys.stderr, flush=True)

    report = build_report(
        load_scenario(Path(args.scenario)),
        split_budget=args.search_split,
        search_layout=args.search_layout,
        progress=progress,
    )
    print(report.to_json() if args.json else report.to_text())
    return 0


def _dashboard(args: argparse.Namespace) -> int:
    from sharpen.monitoring.dashboard import DashboardServer

    try:
        server = DashboardServer(Path(args.runs_dir), host=args.host, port=args.port, allowed_hosts=args.allow_host)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    except OSError as error:  # the port is taken, or the host is not an address of this machine
        raise ConfigError(f"dashboard: cannot listen on {args.host}:{args.port}: {error.strerror}") from None
    print(f"dashboard of {args.runs_dir} at {server.url}", flush=True)
    try:
        server.serve_forever()
    finally:
        server.close()
    return 0


def _exit_on_sigterm(signum: int, frame: object) -> None:
    """SIGTERM (a scheduler, `kill`, a CI timeout) unwinds like Ctrl-C, so `finally` blocks shut the engine's
    child processes down; by default Python dies at once and leaves vLLM's engine processes orphaned."""
    raise SystemExit(128 + signum)


def _print_deprecation(message: Warning | str, category: type[Warning], *args: object, **kwargs: object) -> None:
    """A moved config key is one ``sharpen:`` line on stderr, like an error, not a warning with a source line."""
    if issubclass(category, DeprecatedKeyWarning):
        print(f"sharpen: {message}", file=sys.stderr)
    else:
        _show_warning(message, category, *args, **kwargs)  # pyright: ignore[reportArgumentType]


_show_warning = warnings.showwarning


def _is_user_error(error: BaseException) -> bool:
    """Whether ``error`` is bad input that `main` reports in one line (not a failure whose traceback is logged)."""
    from sharpen.cli.errors import user_error_message

    if isinstance(error, ConfigError | ModelNotFoundError):
        return True
    return isinstance(error, Exception) and user_error_message(error) is not None


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(_resume_last(list(sys.argv[1:] if argv is None else argv)))
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _exit_on_sigterm)
    warnings.showwarning = _print_deprecation
    try:
        return _run(args)
    except (ConfigError, ModelNotFoundError) as error:
        print(f"sharpen: {error}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print("sharpen: interrupted", file=sys.stderr)
        return 130
    except Exception as error:
        from sharpen.cli.errors import user_error_message

        message = user_error_message(error)
        if message is None:
            raise
        print(f"sharpen: {message}", file=sys.stderr)
        return EXIT_USER_ERROR


if __name__ == "__main__":
    sys.exit(main())
