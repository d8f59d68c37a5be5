"""Inference benchmarks: router path vs direct engine, and filesystem weight update vs plain load.

    .venv/bin/python benchmarks/inference.py [--model DIR] [--requests 32] [--max-tokens 64]

Starts one `inference` replica (no bus) on a tiny model built offline (or --model), then prints:
1. completion tokens/s of N concurrent chat completions through the public port (:server.port:
   the allow-list gate in front of vLLM) and straight to the engine (:backend_port), with
   ratios; and the median latency of one short completion on each path (what the gate's hop
   costs; benchmarks/replica_hop.py compares it with a vllm-router in between);
2. seconds of `/update_weights` of a safetensors directory (checksums, pause, in-place reload,
   prefix-cache reset, resume) vs `safetensors.torch.load_file` of the same files, and the ratio.
Numbers, not assertions: tests never time anything.
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

TESTS = Path(__file__).resolve().parents[1] / "tests"
sys.path[:0] = [str(TESTS / "integration" / "inference"), str(TESTS)]  # + replica_support


async def tokens_per_second(url: str, model: str, num_requests: int, max_tokens: int) -> float:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Reverse: benchmark"}],
        "max_tokens": max_tokens,
        "min_tokens": max_tokens,
        "temperature": 1.0,
        "logprobs": True,
        "return_token_ids": True,
    }
    async with httpx.AsyncClient(timeout=300) as client:
        start = time.perf_counter()
        responses = await asyncio.gather(
            *[client.post(url + "/v1/chat/completions", json=body) for _ in range(num_requests)]
        )
        elapsed = time.perf_counter() - start
    if bad := [r for r in responses if r.status_code != 200]:
        raise RuntimeError(f"{url}: {len(bad)} answers were {bad[0].status_code}: {bad[0].text}")
    tokens = sum(r.json()["usage"]["completion_tokens"] for r in responses)
    return tokens / elapsed


async def latency_s(url: str, model: str, num_requests: int = 20) -> float:
    """Median seconds of one 1-token chat completion, sent one after another."""
    body = {"model": model, "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
    times = []
    async with httpx.AsyncClient(timeout=60) as client:
        for _ in range(num_requests):
            start = time.perf_counter()
            response = await client.post(url + "/v1/chat/completions", json=body)
            times.append(time.perf_counter() - start)
            assert response.status_code == 200, response.text
    return statistics.median(times)


def time_update(engine_url: str, model: Path, run_dir: Path, version: int) -> float:
    """One /update_weights of a copy of the model's files under the run's broadcasts directory
    (the only place the engine accepts weights from)."""
    import shutil

    from inference_helpers import make_published

    weights_dir = run_dir / "broadcasts" / f"step_{version}"
    weights_dir.mkdir(parents=True)
    for path in model.glob("*.safetensors"):
        shutil.copy(path, weights_dir / path.name)
    published = make_published(version, weights_dir)
    start = time.perf_counter()
    response = httpx.post(
        engine_url + "/update_weights",
        timeout=300,
        json={
            "version": version,
            "path": str(weights_dir),
            "sha256": {f.name: f.sha256 for f in published.files},
        },
    )
    assert response.status_code == 200, response.text
    return time.perf_counter() - start


def time_plain_load(weights_dir: Path) -> float:
    from safetensors.torch import load_file

    start = time.perf_counter()
    for path in sorted(weights_dir.glob("*.safetensors")):
        load_file(str(path))
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="model dir (default: a tiny Qwen3 built here)")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    from inference_helpers import make_base_model, start_replica

    root = Path(tempfile.mkdtemp(prefix="rlbus-bench-inference-"))
    model = args.model or make_base_model(root / "model")
    replica = start_replica(model, root / "run", replica_id="bench", bus_args=[])
    try:
        name = str(model)
        asyncio.run(tokens_per_second(replica.engine_url, name, 4, 8))  # warm-up (logprobs path)
        paths = {"direct engine": replica.engine_url, "public (gate)": replica.public_url}
        rates: dict[str, list[float]] = {label: [] for label in paths}
        for _ in range(args.repeats):
            for label, url in paths.items():
                rate = tokens_per_second(url, name, args.requests, args.max_tokens)
                rates[label].append(asyncio.run(rate))
        median = {label: statistics.median(values) for label, values in rates.items()}
        latency = {label: asyncio.run(latency_s(url, name)) for label, url in paths.items()}
        d = median["direct engine"]
        print(f"{args.requests} concurrent x {args.max_tokens} tokens, median of {args.repeats}")
        for label in paths:
            print(
                f"  {label:14} {median[label]:9.0f} tok/s   /direct = {median[label] / d:.2f}   "
                f"1-token latency {latency[label] * 1000:6.1f} ms"
            )

        updates = [
            time_update(replica.engine_url, model, root / "run", version)
            for version in range(1, args.repeats + 2)
        ]
        plain = [time_plain_load(model) for _ in range(args.repeats + 1)]
        u, p = statistics.median(updates), statistics.median(plain)
        size_mb = sum(f.stat().st_size for f in model.glob("*.safetensors")) / 1e6
        print(f"weights: {size_mb:.1f} MB safetensors")
        print(
            f"  /update_weights          {u * 1000:8.1f} ms "
            "(sha256 + checks + pause + reload + resume)"
        )
        print(f"  safetensors load_file    {p * 1000:8.1f} ms   update/plain = {u / p:.1f}x")
    finally:
        replica.stop()


if __name__ == "__main__":
    main()
