"""Orchestrator throughput: rollouts/s and where a step's time goes, with 1, 2 and 4 workers.

    uv run python benchmarks/orchestrator.py                      # fake inference (isolates the orchestrator)
    uv run python benchmarks/orchestrator.py --inference-url http://127.0.0.1:8000/v1 --model /path/to/model

By default inference is a fake OpenAI server in a subprocess that answers every chat request
after `--latency-ms` with `--completion-tokens` tokens, so the numbers measure the orchestrator
(bus, workers, coordinator, packing) rather than vLLM. A real nats-server runs in a temp dir.
Printed per worker count: samples/s, steps/s, and per step the coordinator's own time vs time
spent waiting for rollouts, side by side with the 1-worker run as ratios. samples/s is steady
state (batch size / mean step time, first step excluded). `--processes` runs the
workers as separate `orchestrator --role worker` processes (wall time then includes their start).
"""

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from rlbus.netutil import free_port


def serve_fake(port: int, latency_ms: float, completion_tokens: int) -> None:
    """A minimal OpenAI chat endpoint returning token ids + logprobs (vLLM response shape)."""
    import uvicorn
    from fastapi import FastAPI, Request

    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        await asyncio.sleep(latency_ms / 1000)
        n = min(completion_tokens, body.get("max_tokens", completion_tokens))
        text = "".join(
            chr(97 + (hash((json.dumps(body["messages"]), i, time.time_ns())) % 26))
            for i in range(n)
        )
        return {
            "id": "x",
            "object": "chat.completion",
            "created": 0,
            "model": body["model"],
            "prompt_token_ids": list(range(40)),
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": "stop",
                    "token_ids": [97 + (ord(c) - 97) for c in text],
                    "logprobs": {
                        "content": [
                            {"token": c, "logprob": -1.0, "bytes": None, "top_logprobs": []}
                            for c in text
                        ]
                    },
                }
            ],
            "usage": {"prompt_tokens": 40, "completion_tokens": n, "total_tokens": 40 + n},
        }

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


async def run_once(server, url: str, model: str, num_workers: int, args) -> dict:
    from rlbus.bus import Bus
    from rlbus.configs.bus import BusConfig
    from rlbus.configs.orchestrator import OrchestratorConfig
    from rlbus_orchestrator.service import serve

    run_id = f"bench_{uuid.uuid4().hex[:6]}"
    bus_config = BusConfig(url=server.url, token=server.token, run_id=run_id)
    config = OrchestratorConfig(
        run={"name": run_id},
        bus=bus_config,
        model={"name": model},
        inference_urls=[url],
        batch_size=args.batch_size,
        group_size=args.group_size,
        max_steps=args.steps,
        async_level=args.steps,
        num_workers=num_workers,
        max_concurrency=args.concurrency,
        seq_len=512,
        sampling={"max_tokens": args.completion_tokens},
        filter_zero_advantage=False,
        otel={"enabled": False},
        output_dir=args.tmp,
    )
    procs = []
    if (
        args.processes
    ):  # scale-out mode: N `orchestrator --role worker` processes + the coordinator here
        config = config.model_copy(update={"role": "coordinator"})
        worker_args = [
            "--role",
            "worker",
            "--run.name",
            run_id,
            "--output-dir",
            args.tmp,
            "--bus.url",
            server.url,
            "--model.name",
            model,
            "--inference-urls",
            url,
            "--group-size",
            str(args.group_size),
            "--max-concurrency",
            str(args.concurrency),
            "--sampling.max-tokens",
            str(args.completion_tokens),
            "--log.level",
            "warning",
        ] + (["--bus.token", server.token] if server.token else [])
        cmd = [sys.executable, "-c", "from rlbus_orchestrator.entrypoint import main; main()"]
        procs = [
            subprocess.Popen(cmd + worker_args, stdout=subprocess.DEVNULL)
            for _ in range(num_workers)
        ]
    started = time.perf_counter()
    try:
        await serve(config)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait()
    wall = time.perf_counter() - started
    bus = await Bus.connect(bus_config, run_id=run_id, name="bench")
    metrics = []
    for step in range(1, args.steps + 1):
        metrics.append((await bus.step_log.read(step)).metrics)
    await bus.close()
    skip = metrics[1:] or metrics  # step 1 includes start-up
    return {
        "workers": num_workers,
        "wall_s": wall,
        # steady state: steps after the first (which includes start-up of workers and connections)
        "samples_per_s": args.batch_size / statistics.fmean(m["time/step_s"] for m in skip),
        "own_s": statistics.fmean(m["time/orchestrator_s"] for m in skip),
        "wait_s": statistics.fmean(m["time/wait_rollouts_s"] for m in skip),
        "step_s": statistics.fmean(m["time/step_s"] for m in skip),
    }


async def main_async(args) -> None:
    import structlog

    from rlbus.bus import NatsServer

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(30))
    fake = None
    url, model = args.inference_url, args.model
    if url is None:
        port = free_port()
        fake = subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--serve-fake",
                str(port),
                "--latency-ms",
                str(args.latency_ms),
                "--completion-tokens",
                str(args.completion_tokens),
            ]
        )
        url, model = f"http://127.0.0.1:{port}/v1", "fake"
        await asyncio.sleep(3)
    with tempfile.TemporaryDirectory() as tmp:
        args.tmp = tmp
        server = NatsServer(Path(tmp) / "nats").start()
        try:
            results = [await run_once(server, url, model, n, args) for n in args.workers]
        finally:
            server.stop(timeout_s=5)
            if fake is not None:
                fake.terminate()
                fake.wait()
    base = results[0]
    mode = "worker processes" if args.processes else "in-process workers"
    print(
        f"\norchestrator benchmark ({mode}): {args.steps} steps x {args.batch_size} samples (group {args.group_size}), "
        f"max_concurrency {args.concurrency}/worker, inference {f'fake {args.latency_ms}ms' if fake else url}"
    )
    print(
        f"{'workers':>7} {'samples/s':>10} {'x1w':>6} {'step s':>8} {'own s/step':>11} {'wait s/step':>12} {'own %':>6}"
    )
    for r in results:
        print(
            f"{r['workers']:>7} {r['samples_per_s']:>10.1f} {r['samples_per_s'] / base['samples_per_s']:>6.2f} "
            f"{r['step_s']:>8.3f} {r['own_s']:>11.4f} {r['wait_s']:>12.3f} {100 * r['own_s'] / max(r['step_s'], 1e-9):>6.1f}"
        )


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--serve-fake", type=int, help=argparse.SUPPRESS)
    p.add_argument("--inference-url")
    p.add_argument("--model", default="fake")
    p.add_argument("--latency-ms", type=float, default=50.0)
    p.add_argument("--completion-tokens", type=int, default=12)
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument(
        "--processes", action="store_true", help="workers as separate `--role worker` processes"
    )
    args = p.parse_args()
    if args.serve_fake:
        serve_fake(args.serve_fake, args.latency_ms, args.completion_tokens)
        return
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
