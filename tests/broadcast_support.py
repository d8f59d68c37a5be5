"""Receivers of the weight broadcast (`rlbus.broadcast`) as real processes, for the group tests.

`spawn_receiver` runs `RECEIVER` in a subprocess: once torch is imported it says `ready` and
reads its orders (one line of arguments, sent by `join`) from stdin, so that its start-up
(seconds on a busy machine) does not eat into the group's rendezvous deadline. Then it joins
the group as one rank, receives versions until the sender closes the group, and writes after
each version (and on an error) a JSON list to `out`: {"version", "sums": {name: float}} per
version, {"error": message} last (then it stays up 3 s, as a worker process would: its liveness
counter keeps moving).
Mode `die_after_header` exits the process (code 3) right after the first header, mid-version.
"""

import json
import subprocess
import sys
import time
from pathlib import Path

RECEIVER = """
import json, os, sys, time
import torch
from rlbus import broadcast

print("ready", flush=True)
host, port, rank, world, timeout_s, mode, out, device = sys.stdin.readline().split()
LINGER_S = 3
results = []

def write():
    with open(out + ".tmp", "w") as f:
        json.dump(results, f)
    os.replace(out + ".tmp", out)

try:
    group = broadcast.open_group(
        host, int(port), int(rank), int(world), float(timeout_s), torch.device(device)
    )
    while (header := broadcast.receive_header(group)) is not None:
        if mode == "die_after_header":
            os._exit(3)
        tensors = dict(broadcast.receive_tensors(group, header))
        sums = {name: float(t.double().sum()) for name, t in tensors.items()}
        results.append({"version": header.version, "sums": sums})
        write()
    results.append({"closed": True})
except broadcast.BroadcastError as error:
    results.append({"error": str(error)})
    write()
    time.sleep(LINGER_S)  # a worker process stays up after a failed version
write()
"""


def spawn_receiver() -> subprocess.Popen:
    """A receiver process with torch imported, waiting for `join`."""
    process = subprocess.Popen(
        [sys.executable, "-c", RECEIVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert process.stdout.readline().strip() == "ready"
    return process


def join(
    process: subprocess.Popen,
    port: int,
    rank: int,
    world_size: int,
    out: Path,
    *,
    host: str = "127.0.0.1",
    timeout_s: float = 3,
    mode: str = "normal",
    device: str = "cpu",
) -> subprocess.Popen:
    """Order a spawned receiver to join the group at host:port as `rank`."""
    args = [host, str(port), str(rank), str(world_size), str(timeout_s), mode, str(out), device]
    process.stdin.write(" ".join(args) + "\n")
    process.stdin.close()
    return process


def results(out: Path) -> list[dict]:
    return json.loads(out.read_text()) if out.exists() else []


def stop(processes: list[subprocess.Popen], timeout_s: float = 15) -> list[int]:
    """Wait for each process (by its PID) up to `timeout_s` in all, kill those still running;
    returns their exit codes."""
    deadline = time.monotonic() + timeout_s
    for process in processes:
        try:
            process.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        process.stdout.close()
    return [process.returncode for process in processes]
