"""Orchestrator throughput: rollouts/s and where a step's time goes, with 1, 2 and 4 workers.

    uv run python benchmarks/orchestrator.py                      # fake inference (isolates the orchestrator)
    uv run python benchmarks/orchestrator.py --inference-url http://127.0.0.1:8000/v1 --model /path/to/model
    uv run python benchmarks/orchestrator.py --group-compare --serve-model examples/reverse-text/model

By default inference is a fake OpenAI server in a subprocess that answers every chat request
after `--latency-ms` with `--completion-tokens` tokens, so the numbers measure the orchestrator
(bus, workers, coordinator, packing) rather than vLLM. A real nats-server runs in a temp dir.
Printed per worker count: samples/s, steps/s, and per step the coordinator's own time vs time
spent waiting for rollouts, side by side with the 1-worker run as ratios. samples/s is steady
state (batch size / mean step time, first step excluded). `--processes` runs the
workers as separate `orchestrator --role worker` processes (wall time then includes their start).

`--group-compare` measures generation alone, against real inference (`--inference-url`, or
`--serve-model DIR`: a vLLM engine on DIR started here with the example's settings): per step,
`batch_size / group_size` reverse-text groups go through a rollout worker's `roll_out`, once with
one `n=group_size` request per group and once with one request per sample, alternating which
goes first; every run gets new prompts (no prefix-cache hits between the two). It prints the
mean and median step time of each (step 0 of each, the warm-up, excluded) and their ratio.
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

from rlbus import process_marks
from rlbus.netutil import free_port


def fake_choice(body: dict, index: int, length: int) -> dict:
    """Choice `index` of a fake completion: `length` random letters, one token each."""
    text = "".join(
        chr(97 + (hash((json.dumps(body["messages"]), index, i, time.time_ns())) % 26))
        for i in range(length)
    )
    return {
        "index": index,
        "message": {"role": "assistant", "content": text},
        "finish_reason": "stop",
        "token_ids": [ord(c) for c in text],
        "logprobs": {
            "content": [
                {"token": c, "logprob": -1.0, "bytes": None, "top_logprobs": []} for c in text
            ]
        },
    }


def serve_fake(port: int, latency_ms: float, completion_tokens: int) -> None:
    """A minimal OpenAI chat endpoint returning token ids + logprobs (vLLM response shape)."""
    import uvicorn
    from fastapi import FastAPI, Request

    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        await asyncio.sleep(latency_ms / 1000)
        length = min(completion_tokens, body.get("max_tokens", completion_tokens))
        choices = [fake_choice(body, index, length) for index in range(body.get("n", 1))]
        return {
            "id": "x",
            "object": "chat.completion",
            "created": 0,
            "model": body["model"],
            "prompt_token_ids": list(range(40)),
            "choices": choices,
            "usage": {
                "prompt_tokens": 40,
                "completion_tokens": length * len(choices),
                "total_tokens": 40 + length * len(choices),
            },
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


def start_engine(model_dir: str, port: int) -> subprocess.Popen:
    """vLLM's OpenAI server on `model_dir` with the flags `inference` gives it for the example
    (examples/reverse-text/rl.toml: 256 MiB CPU KV cache, eager), in its own process group."""
    from rlbus.configs.inference import InferenceConfig
    from rlbus_inference.engine_process import on_cpu

    config = InferenceConfig(
        vllm={"model": model_dir, "enforce_eager": True, "cpu_kv_cache_bytes": "256MiB"}
    )
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--host", "127.0.0.1"]
    command += ["--port", str(port), *config.vllm_cli_args(on_cpu=on_cpu())]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, start_new_session=True)


async def wait_healthy(url: str, engine: subprocess.Popen, timeout_s: float = 600) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient() as http:
        while time.monotonic() < deadline:
            if engine.poll() is not None:
                raise SystemExit(f"--serve-model: the vLLM engine exited with {engine.returncode}")
            try:
                if (await http.get(url.removesuffix("/v1") + "/health")).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            await asyncio.sleep(1)
    raise SystemExit(f"--serve-model: the vLLM engine was not healthy within {timeout_s:.0f} s")


async def time_step(worker, tasks) -> float:
    """Seconds to roll out `tasks` concurrently through `worker` (what a step waits for)."""
    started = time.perf_counter()
    rollouts = await asyncio.gather(*(worker.roll_out(t) for t in tasks))
    elapsed = time.perf_counter() - started
    failed = [r.error for r in rollouts if r.error]
    if failed:
        raise SystemExit(f"a rollout failed: {failed[0]}")
    return elapsed


async def group_compare(url: str, model: str, args) -> dict[str, list[float]]:
    """Step times with one request per group vs one per sample (module docstring)."""
    from rlbus.configs.orchestrator import InferenceHttpConfig
    from rlbus.wire.tasks import SamplingArgs, Task
    from rlbus_orchestrator.client import (
        InferenceClient,
        ReplicaPool,
        make_http_client,
        static_replicas,
    )
    from rlbus_orchestrator.envs import ReverseTextEnv
    from rlbus_orchestrator.worker import RolloutWorker

    env = ReverseTextEnv()
    sampling = SamplingArgs(temperature=1.0, max_tokens=args.completion_tokens)
    pool = ReplicaPool()
    pool.update(static_replicas([url], model))
    times: dict[str, list[float]] = {"grouped": [], "per-sample": []}
    cursor = 0
    async with make_http_client(InferenceHttpConfig(), args.concurrency) as http:
        client = InferenceClient(pool, http, model)
        workers = {
            mode: RolloutWorker(
                None,  # roll_out alone: no bus
                client,
                max_concurrency=args.concurrency,
                group_size=args.group_size,
                group_requests=mode == "grouped",
            )
            for mode in times
        }
        for step in range(args.steps + 1):
            for mode in list(times)[:: 1 if step % 2 else -1]:
                tasks = []
                for _ in range(args.batch_size // args.group_size):
                    task_id = f"train-{cursor}"
                    problem = env.example("train", cursor)
                    cursor += 1
                    tasks.append(
                        Task(
                            task_id=task_id,
                            step=step,
                            env_id=env.env_id,
                            problem=problem,
                            sampling=sampling,
                            group_size=args.group_size,
                        )
                    )
                times[mode].append(await time_step(workers[mode], tasks))
    return {mode: values[1:] for mode, values in times.items()}


def print_group_compare(times: dict[str, list[float]], url: str, args) -> None:
    groups = args.batch_size // args.group_size
    print(
        f"\ngeneration per step ({args.steps} steps each, alternating, warm-up excluded): "
        f"{groups} groups x {args.group_size} samples, max_concurrency {args.concurrency}, "
        f"{args.completion_tokens} max tokens, temperature 1, inference {url}"
    )
    print(f"{'requests':>10} {'per step':>9} {'mean s':>8} {'median s':>9} {'samples/s':>10}")
    for mode, values in times.items():
        requests = groups if mode == "grouped" else groups * args.group_size
        mean = statistics.fmean(values)
        print(
            f"{mode:>10} {requests:>9} {mean:>8.3f} {statistics.median(values):>9.3f} "
            f"{args.batch_size / mean:>10.1f}"
        )
    ratio = statistics.fmean(times["grouped"]) / statistics.fmean(times["per-sample"])
    print(f"grouped / per-sample step time: {ratio:.2f} (mean)")


async def run_group_compare(args) -> None:
    url, model, engine = args.inference_url, args.model, None
    if args.serve_model:
        port = free_port()
        url, model = f"http://127.0.0.1:{port}/v1", args.serve_model
        engine = start_engine(args.serve_model, port)
    try:
        if engine is not None:
            await wait_healthy(url, engine)
        times = await group_compare(url, model, args)
    finally:
        if engine is not None:
            process_marks.stop_group(engine)
    print_group_compare(times, url, args)


async def main_async(args) -> None:
    import structlog

    from rlbus_launch.natsserver import NatsServer

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
    p.add_argument(
        "--group-compare",
        action="store_true",
        help="generation time per step, one request per group vs one per sample",
    )
    p.add_argument("--serve-model", help="with --group-compare: start a vLLM engine on this model")
    args = p.parse_args()
    if args.serve_fake:
        serve_fake(args.serve_fake, args.latency_ms, args.completion_tokens)
        return
    if args.group_compare:
        if not (args.serve_model or args.inference_url):
            p.error(
                "--group-compare needs real inference: --serve-model DIR or --inference-url URL"
            )
        if args.batch_size % args.group_size:
            p.error(f"--batch-size ({args.batch_size}) must be a multiple of --group-size")
        asyncio.run(run_group_compare(args))
        return
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
