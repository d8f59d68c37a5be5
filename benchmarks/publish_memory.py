"""Peak extra memory of one filesystem weight publish: the full gather + one-file write of before
against the tensor-by-tensor shards of `rlbus_trainer.safetensors_stream`, in the same run.

    ./uvw run python benchmarks/publish_memory.py [--ranks 1,2] [--hidden 768 --layers 12
        --vocab 32000 --intermediate 2048] [--max-shard-size 200MB]

A random-init Qwen3 (built offline with `rlbus_trainer.tiny_model.build_tiny_model`, about 100M
parameters with the defaults, float32) is loaded into the trainer's engine (`build_engine`: a
plain module on 1 rank, FSDP2 over gloo on 2, started with torchrun). Each case runs in fresh
processes, so one case's peak cannot hide another's. Rank 0 reads its resident set size before
the publish, resets the kernel's high-water mark (`/proc/self/clear_refs` 5), publishes, and
reports `VmHWM - VmRSS before`: what the publish itself added at its peak (files written go to
the page cache, which no process's RSS counts).

- old: `Engine.full_state_dict()` (the whole model on rank 0), `hf_dir.write_hf_dir` (one
  `model.safetensors` through `safetensors.torch.save_file`), then `weight_files` reads each
  file back to hash it: the publish path before issue 34.
- new: `FilesystemWeightPublisher.write_version` (stream_state walk, shards, hashed while written).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = """
import asyncio, json, sys, time
import torch
from rlbus.checksums import weight_files
from rlbus.configs.trainer import TrainerConfig
from rlbus_trainer.engine import build_engine, setup_distributed, teardown_distributed
from rlbus_trainer.hf_dir import write_hf_dir
from rlbus_trainer.weights import FilesystemWeightPublisher

def status(key):
    line = next(l for l in open("/proc/self/status") if l.startswith(key + ":"))
    return int(line.split()[1]) * 1024

config = TrainerConfig.model_validate(json.loads(sys.argv[1]))
case, run_dir, report = sys.argv[2], sys.argv[3], sys.argv[4]
world = setup_distributed()
try:
    engine = build_engine(config, world)
    for tensor in engine.model.state_dict().values():  # page in weights the load left mapped
        (tensor.to_local() if hasattr(tensor, "to_local") else tensor).sum()
    before = status("VmRSS")
    open("/proc/self/clear_refs", "w").write("5")  # the high-water mark starts from here
    t0 = time.perf_counter()
    out = f"{run_dir}/{case}"
    if case == "old":
        state = engine.full_state_dict()
        if world.is_main:
            write_hf_dir(state, config.model.name, out)
            files = weight_files(out)
        del state
    else:
        publisher = FilesystemWeightPublisher(config, bus=None, run_dir=run_dir, world=world)
        async def fresh(step):
            return False
        publisher._stale = fresh  # no bus in this benchmark: every version is new
        asyncio.run(publisher.write_version(1, engine, publisher.root / case))
    seconds = time.perf_counter() - t0
    if world.is_main:
        num_bytes = sum(p.numel() * p.element_size() for p in engine.model.parameters())
        open(report, "w").write(json.dumps(
            {"extra": status("VmHWM") - before, "seconds": seconds, "model_bytes": num_bytes}
        ))
finally:
    teardown_distributed()
"""


def run_case(case: str, ranks: int, config: dict, tmp: Path) -> dict:
    """One publish in fresh processes (torchrun for 2+ ranks); rank 0's report."""
    report = tmp / f"{case}-{ranks}.json"
    script = tmp / "child.py"
    script.write_text(CHILD)
    args = [json.dumps(config), case, str(tmp / f"run-{ranks}"), str(report)]
    launcher = [sys.executable]
    if ranks > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([*launcher, str(script), *args], env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{case} on {ranks} rank(s) failed:\n{done.stderr[-3000:]}")
    return json.loads(report.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="1,2", help="comma-separated rank counts")
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--intermediate", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--max-shard-size", default="200MB")
    args = parser.parse_args()
    from rlbus_trainer.tiny_model import build_tiny_model

    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        t0 = time.perf_counter()
        model = build_tiny_model(
            tmp / "model",
            hidden_size=args.hidden,
            num_layers=args.layers,
            num_heads=args.hidden // 64,
            head_dim=64,
            num_kv_heads=4,
            intermediate_size=args.intermediate,
            vocab_size=args.vocab,
        )
        print(f"model built in {time.perf_counter() - t0:.0f} s", flush=True)
        config = {
            "model": {"name": str(model)},
            "weight_broadcast": {"max_shard_size": args.max_shard_size},
        }
        rows = []
        for ranks in (int(r) for r in args.ranks.split(",")):
            old, new = (run_case(case, ranks, config, tmp) for case in ("old", "new"))
            rows.append((ranks, old, new))
    mib = 1024**2
    print(f"model: {rows[0][1]['model_bytes'] / mib:.0f} MiB of parameters (float32)")
    print("ranks | old extra MiB | new extra MiB | old/new | old s | new s")
    for ranks, old, new in rows:
        ratio = max(old["extra"], mib) / max(new["extra"], mib)  # under 1 MiB counts as 1 MiB
        print(
            f"{ranks:5d} | {old['extra'] / mib:13.0f} | {new['extra'] / mib:13.0f} | "
            f"{ratio:7.1f} | {old['seconds']:5.1f} | {new['seconds']:5.1f}"
        )


if __name__ == "__main__":
    main()
