"""Inference benchmarks: router path vs direct engine, and filesystem weight update vs plain load.

    .venv/bin/python benchmarks/inference.py [--model DIR] [--requests 32] [--max-tokens 64]

Starts one `inference` replica (no bus) on a tiny model built offline (or --model), then prints:
1. completion tokens/s of N concurrent chat completions through the router (:server.port) vs
   straight to the engine (:backend_port), and their ratio;
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "integration" / "inference"))


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
    tokens = sum(r.json()["usage"]["completion_tokens"] for r in responses)
    return tokens / elapsed


def time_update(engine_url: str, weights_dir: Path, version: int) -> float:
    from inference_helpers import make_published

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
        direct, routed = [], []
        for _ in range(args.repeats):
            direct.append(
                asyncio.run(
                    tokens_per_second(replica.engine_url, name, args.requests, args.max_tokens)
                )
            )
            routed.append(
                asyncio.run(
                    tokens_per_second(replica.router_url, name, args.requests, args.max_tokens)
                )
            )
        d, r = statistics.median(direct), statistics.median(routed)
        print(f"{args.requests} concurrent x {args.max_tokens} tokens, median of {args.repeats}")
        print(f"  direct engine  {d:9.0f} tok/s")
        print(f"  via router     {r:9.0f} tok/s   router/direct = {r / d:.2f}")

        updates = [
            time_update(replica.engine_url, model, version)
            for version in range(1, args.repeats + 2)
        ]
        plain = [time_plain_load(model) for _ in range(args.repeats + 1)]
        u, p = statistics.median(updates), statistics.median(plain)
        size_mb = sum(f.stat().st_size for f in model.glob("*.safetensors")) / 1e6
        print(f"weights: {size_mb:.1f} MB safetensors")
        print(f"  /update_weights          {u * 1000:8.1f} ms (sha256 + pause + reload + resume)")
        print(f"  safetensors load_file    {p * 1000:8.1f} ms   update/plain = {u / p:.1f}x")
    finally:
        replica.stop()


if __name__ == "__main__":
    main()
