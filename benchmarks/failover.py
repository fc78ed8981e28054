"""Recovery from a killed engine server, measured in one run: two `vllm_server` replicas of SmolLM2-135M (vLLM's CPU
build) behind `EngineRouter`, episodes through `EpisodeRunner`, and one server's process group killed with SIGKILL
(kill -9) while it generates. The same episodes run once without the kill first, with the same seeds.

Prints, from the kill: when the router saw the failure, when the first and the last of the killed server's requests
were served again by the other replica, when the run had every episode, when the server was back (restarted, out of
rotation) and when it served again (after the weight sync that followed); and the samples lost and duplicated
(counted by episode id: example and sample index; goal 0 and 0) and the episodes whose tokens differ from the run
without the kill (goal 0: a re-sent request keeps its seed).

    .venv/bin/python benchmarks/failover.py [--episodes 24] [--max-new-tokens 48] [--kill-after 1.0]
"""

from __future__ import annotations

import argparse
import collections
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from sharpen.config.engines import FailoverConfig, VllmServerEngineConfig
from sharpen.config.models import resolve_model_path
from sharpen.rollout.engines.failover import ReplicaState
from sharpen.rollout.engines.router import EngineRouter
from sharpen.rollout.episodes import EpisodeRunner
from sharpen.types import Example, Message, SamplingParams

TOPICS = ["a lighthouse", "a market", "the sea", "a library", "a mountain", "a train", "a garden", "a storm"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--episodes", type=int, default=24, help="episodes per run (two samples per example)")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--kill-after", type=float, default=1.0, help="seconds after the server's first request")
    args = parser.parse_args()

    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    from sharpen.rollout.engines.vllm_server import VllmServerEngine

    model_path = resolve_model_path("smollm2-135m-instruct")
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    started = time.monotonic()

    def start(_: int) -> VllmServerEngine:
        return VllmServerEngine(VllmServerEngineConfig(), model_path=model_path, dtype="float32", seed=0)

    with ThreadPoolExecutor(2) as pool:
        engines = list(pool.map(start, range(2)))
    print(f"two vllm_server replicas ready in {time.monotonic() - started:.1f} s")
    router = EngineRouter(engines, failover=FailoverConfig())
    weights = list(load_file(str(model_path / "model.safetensors")).items())  # the checkpoint's names and tensors
    router.load_weights(weights, version=1)  # past the first sync: the restarted server waits for the next one

    examples = [
        Example(task_key=f"story/{i}", prompt=(Message(role="user", content=f"Tell a story about {TOPICS[i % 8]}."),))
        for i in range(args.episodes // 2)
    ]
    runner = EpisodeRunner(tokenizer=tokenizer, request_timeout_s=600)
    sampling = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=1.0)

    def run() -> tuple[list[tuple[str, int, tuple[int, ...]]], float]:
        began = time.monotonic()
        groups = runner.generate_groups(router, examples, sampling=sampling, num_samples=2, seed="failover/0")
        return [
            (r.example.task_key, r.sample_index, tuple(r.completion_ids)) for g in groups for r in g.rollouts
        ], began

    reference, began = run()
    print(f"run without the kill: {len(reference)} episodes in {time.monotonic() - began:.1f} s")
    router.pop_metrics()
    victim = engines[1]
    assert victim.server is not None
    killed_at: list[float] = []

    def kill_mid_run() -> None:
        while router.in_flight[1] == 0:
            time.sleep(0.005)
        time.sleep(args.kill_after)
        assert victim.server is not None
        os.killpg(victim.server.process.pid, signal.SIGKILL)
        killed_at.append(time.monotonic())

    killer = threading.Thread(target=kill_mid_run, daemon=True)
    killer.start()
    try:
        rollouts, began = run()
        error = None
    except Exception as failure:  # the run stopped: every sample of it is lost
        rollouts, error = [], failure
    done_at = time.monotonic()
    killer.join(timeout=10)
    metrics = router.pop_metrics()
    while router.health.states[1] is ReplicaState.RESTARTING:
        time.sleep(0.1)
    back_at = time.monotonic()
    if router.health.states[1] is ReplicaState.STANDBY:
        router.load_weights(weights, version=2)  # the next step's sync
    rejoined_at = time.monotonic()
    routed = router.num_routed[1]
    router.generate([[1, 504, 3458]] * 4, [SamplingParams(max_new_tokens=4, seed=s) for s in range(4)])
    serves_again = router.num_routed[1] > routed

    kill = killed_at[0]
    events = [e for e in router.health.events if e.replica == 1 or e.kind == "served_retry"]
    down = next((e.at for e in events if e.kind == "down" and e.at >= kill), float("nan"))
    retried = [e.at for e in events if e.kind == "served_retry" and e.at >= kill]
    restarted = next((e.at for e in events if e.kind == "restarted" and e.at >= kill), back_at)
    expected = {(f"story/{i}", s) for i in range(len(examples)) for s in range(2)}
    counts = collections.Counter((key, sample) for key, sample, _ in rollouts)
    lost = len(expected - set(counts))
    duplicated = sum(n - 1 for n in counts.values() if n > 1)
    by_id = {(key, sample): tokens for key, sample, tokens in reference}
    differ = sum(1 for key, sample, tokens in rollouts if by_id.get((key, sample)) != tokens)

    print(
        f"run with the kill {kill - began:.1f} s into it: {len(rollouts)} episodes, ended {done_at - kill:.1f} s "
        f"after the kill{f' with an error: {error}' if error else ''}"
    )
    print(f"requests re-sent: {metrics['rollout/requests_retried']:.0f}; restarts: {metrics['engine/restarts']:.0f}")
    print(f"kill -> failure seen by the router:        {down - kill:7.2f} s")
    if retried:
        print(f"kill -> first re-sent request served:      {retried[0] - kill:7.2f} s")
        print(f"kill -> last re-sent request served:       {retried[-1] - kill:7.2f} s")
    print(f"kill -> every episode of the run done:     {done_at - kill:7.2f} s")
    print(f"kill -> server restarted (standby):        {restarted - kill:7.2f} s")
    print(f"kill -> serving again after a weight sync: {rejoined_at - kill:7.2f} s  (takes requests: {serves_again})")
    print(
        f"samples lost: {lost} (goal 0); duplicated: {duplicated} (goal 0); tokens differ from the run without "
        f"the kill: {differ} of {len(rollouts)} (goal 0)"
    )
    router.close()


if __name__ == "__main__":
    main()
