"""One GPU check of the trainer's model and the weight-broadcast protocol, torch only.

    PYTHONPATH=shared/src:services/trainer/src python benchmarks/gpu_check.py [--out r.json]  # CUDA
    ./uvw run python benchmarks/gpu_check.py --smoke [--out report.json]  # CPU, seconds (CI)

No vLLM, no network, no model files: every model is rlbus's Qwen3 module (rlbus_trainer/qwen3.py)
built with random weights in memory. Per model size it reports:

  - training steps (forward, backward, AdamW) in bf16 on CUDA (float32 in the smoke mode), the
    module wrapped in FSDP2 over a one-rank process group (`fully_shard` per layer and the root,
    as the engine does on 2+ ranks), on packed rows given as a `Documents` layout
    (rlbus_trainer/attention.py): tokens/s after a warm-up step and peak memory
    (torch.cuda.max_memory_allocated; in the smoke mode the process's peak RSS);
  - which SDPA kernel ran: the timed steps run under `sdpa_kernel([FLASH_ATTENTION])`, so they
    fail unless the flash kernel takes every call (then they rerun unforced and say so), and
    the torch profiler's attention op and kernel names of one step are listed.

Then the weight-broadcast protocol of shared/src/rlbus/broadcast.py (send_state_dict ->
receive_header / receive_tensors) between two processes: over NCCL when two GPUs are visible
(through torch.distributed, as the GPU machine has no vLLM for `NcclGroup`), over the real
`GlooGroup` in the smoke mode; skipped with the reason on one GPU. The receiver checks every
tensor bit for bit. docs/gpu.md says what ran where.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import queue
import resource
import socket
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard
from torch.nn.attention import SDPBackend, sdpa_kernel

from rlbus import broadcast
from rlbus_trainer import qwen3
from rlbus_trainer.attention import Documents


@dataclass(frozen=True)
class Size:
    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    rows: int
    seq_len: int


GPU_SIZES = [
    Size("150M-like", 1024, 12, 16, 8, 64, 2816, 32768, rows=4, seq_len=4096),
    Size("0.6B-shaped (Qwen3-0.6B)", 1024, 28, 16, 8, 128, 3072, 151936, rows=2, seq_len=4096),
]
SMOKE_SIZES = [
    Size("smoke-2-layers", 64, 2, 4, 2, 16, 128, 256, rows=2, seq_len=128),
    Size("smoke-4-layers", 64, 4, 4, 2, 16, 128, 256, rows=2, seq_len=128),
]


def build_model(size: Size, device: torch.device, dtype: torch.dtype) -> qwen3.Qwen3ForCausalLM:
    config = qwen3.Qwen3Config(
        vocab_size=size.vocab,
        hidden_size=size.hidden,
        intermediate_size=size.ffn,
        num_hidden_layers=size.layers,
        num_attention_heads=size.heads,
        num_key_value_heads=size.kv_heads,
        head_dim=size.head_dim,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    return qwen3.random_model(config, dtype=dtype, device=device)


def packed_batch(size: Size, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, Documents]:
    """Rows of `seq_len` tokens, each packed with documents of 1/8 to 1/2 of a row."""
    gen = torch.Generator().manual_seed(1)
    rows = []
    for _ in range(size.rows):
        lengths: list[int] = []
        while sum(lengths) < size.seq_len:
            n = int(torch.randint(size.seq_len // 8, size.seq_len // 2, (1,), generator=gen))
            lengths.append(min(n, size.seq_len - sum(lengths)))
        rows.append(lengths)
    ids = torch.randint(0, size.vocab, (size.rows, size.seq_len), generator=gen)
    pos = torch.stack([torch.cat([torch.arange(n) for n in lengths]) for lengths in rows])
    return ids.to(device), pos.to(device), Documents.of_rows(rows, size.seq_len)


def train_steps(model, optimizer, batch, num_steps: int, device: torch.device) -> float:
    """Seconds per step (forward, next-token loss, backward, AdamW), synchronised."""
    ids, pos, documents = batch
    start = time.perf_counter()
    for _ in range(num_steps):
        logits = model(input_ids=ids, position_ids=pos, attention_mask=documents).logits
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / num_steps


def attention_ops(model, optimizer, batch, device: torch.device, forced: bool) -> list[str]:
    """Attention op and kernel names the profiler saw in one step (flash forced as in the timed
    steps when they ran forced)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    flash = sdpa_kernel([SDPBackend.FLASH_ATTENTION]) if forced else contextlib.nullcontext()
    with torch.profiler.profile(activities=activities) as prof, flash:
        train_steps(model, optimizer, batch, 1, device)
    words = ("attention", "flash", "fmha", "cutlass", "sdpa")
    names = {e.name for e in prof.events() if any(w in e.name.lower() for w in words)}
    return sorted(names)[:12]


def check_size(size: Size, device: torch.device, dtype: torch.dtype, steps: int) -> dict:
    model = build_model(size, device, dtype)
    num_params = sum(p.numel() for p in model.parameters())
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    batch = packed_batch(size, device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    forced, error = "FLASH_ATTENTION", None
    try:
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            train_steps(model, optimizer, batch, 1, device)  # warm-up
            seconds = train_steps(model, optimizer, batch, steps, device)
    except RuntimeError as e:  # flash refused a call: say why, measure with SDPA's own choice
        forced, error = None, str(e).splitlines()[0][:300]
        seconds = train_steps(model, optimizer, batch, steps, device)
    result = {
        "size": asdict(size),
        "num_params": num_params,
        "sdpa_forced": forced,
        "flash_error": error,
        "attention_ops": attention_ops(model, optimizer, batch, device, forced is not None),
        "step_s": seconds,
        "tokens_per_s": size.rows * size.seq_len / seconds,
        "peak_memory_mib": peak_memory_mib(device),
        "peak_memory_kind": "cuda max_memory_allocated" if device.type == "cuda" else "peak RSS",
    }
    del model, optimizer, batch
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def checked(size: Size, device: torch.device, dtype: torch.dtype, steps: int) -> dict:
    """`check_size`, or what failed (an out-of-memory on the big size must not cost the rest of
    a GPU session's check)."""
    try:
        return check_size(size, device, dtype, steps)
    except Exception as e:
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return {"size": asdict(size), "error": f"{type(e).__name__}: {str(e)[:300]}"}


def peak_memory_mib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class TorchNcclGroup:
    """`broadcast.BroadcastGroup` over torch.distributed's NCCL default group: the protocol's
    frames over NCCL without vLLM (whose PyNcclCommunicator `broadcast.NcclGroup` uses)."""

    def __init__(self, rank: int, world_size: int, device: torch.device, where: str) -> None:
        self.rank, self.world_size, self.device, self.where = rank, world_size, device, where
        self.closed = False

    def broadcast(self, tensor: torch.Tensor) -> None:
        dist.broadcast(tensor, src=0)

    def all_reduce(self, tensor: torch.Tensor) -> None:
        dist.all_reduce(tensor)

    def silent_ranks(self) -> list[int]:
        return []

    def close(self) -> None:
        self.closed = True


def weights_of(seed: int, device: torch.device, smoke: bool) -> dict[str, torch.Tensor]:
    """A state dict both sides can build alike: bf16 matrices (float32 in the smoke mode) of
    about 0.6B parameters in total (a few thousand in the smoke mode), plus a norm vector."""
    gen = torch.Generator().manual_seed(seed)
    rows, count = (64, 4) if smoke else (3072, 192)
    dtype = torch.float32 if smoke else torch.bfloat16
    tensors = {
        f"layers.{i}.w": torch.randn(rows, 1024 if not smoke else 32, generator=gen)
        for i in range(count)
    }
    tensors["norm.weight"] = torch.ones(7)
    return {name: t.to(dtype).to(device) for name, t in tensors.items()}


def broadcast_worker(rank: int, smoke: bool, port: int, results) -> None:
    """One side of the broadcast (mp.spawn target): rank 0 sends one version, rank 1 receives
    it and compares every tensor with its own copy of the same seeded weights."""
    if smoke:
        device = torch.device("cpu")
        group = broadcast.open_group("127.0.0.1", port, rank, 2, 60.0, device)
    else:
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        init = f"tcp://127.0.0.1:{port}"
        dist.init_process_group("nccl", init_method=init, rank=rank, world_size=2)
        group = TorchNcclGroup(rank, 2, device, init)
    weights = weights_of(0, device, smoke)
    group.broadcast(torch.zeros(1, device=device))  # warm-up: NCCL sets up its channels here
    if rank == 0:
        start = time.perf_counter()
        header = broadcast.send_state_dict(group, 1, weights)  # returns once rank 1 acknowledged
        seconds = time.perf_counter() - start
        broadcast.send_close(group)
        num_bytes = sum(spec.num_bytes for spec in header.tensors)
        results.put({"num_tensors": len(header.tensors), "bytes": num_bytes, "send_s": seconds})
    else:
        header = broadcast.receive_header(group)
        assert header is not None
        received = dict(broadcast.receive_tensors(group, header))
        same = received.keys() == weights.keys() and all(
            torch.equal(received[name], t) for name, t in weights.items()
        )
        results.put(
            {"bit_identical": same, "closed_cleanly": broadcast.receive_header(group) is None}
        )
    group.close()
    if dist.is_initialized():
        dist.destroy_process_group()


def check_broadcast(smoke: bool) -> dict:
    """Both sides of one version: two processes on two GPUs; in the smoke mode two threads of
    this process (each with its own gloo group, as two processes would have; spawning two more
    interpreters that import torch would triple the smoke mode's time)."""
    if not smoke and torch.cuda.device_count() < 2:
        visible = torch.cuda.device_count()
        return {"status": "skipped", "reason": f"{visible} GPU visible: the NCCL check needs two"}
    port = free_port()
    if smoke:
        results: Any = queue.Queue()
        threads = [
            threading.Thread(target=broadcast_worker, args=(rank, True, port, results))
            for rank in (0, 1)
        ]
        for thread in threads:
            thread.start()
    else:
        results = mp.get_context("spawn").SimpleQueue()
        mp.start_processes(broadcast_worker, (False, port, results), nprocs=2, start_method="spawn")
    backend = "gloo (broadcast.GlooGroup)" if smoke else "nccl (torch.distributed)"
    merged: dict = {"status": "ran", "backend": backend}
    for _ in range(2):
        merged.update(results.get())
    merged["gb_per_s"] = merged["bytes"] / merged["send_s"] / 1e9
    return merged


def third_party_modules() -> list[str]:
    """Top-level packages loaded besides the standard library and torch (and what torch pulls
    in): the check must run where only torch is installed."""
    import sys

    ours = {"rlbus", "rlbus_trainer", "torch", "torchgen", "numpy", "typing_extensions"}
    ours |= {"sympy", "mpmath", "triton", "cython_runtime"}  # torch imports them as it runs
    names = {name.split(".")[0] for name in sys.modules}
    return sorted(n for n in names - sys.stdlib_module_names - ours if not n.startswith("_"))


def print_report(report: dict) -> None:
    print(f"device: {report['device']} ({report['dtype']}), torch {report['torch']}")
    for r in report["sizes"]:
        if "error" in r:
            print(f"  {r['size']['name']}: FAILED {r['error']}")
            continue
        kernel = "flash forced" if r["sdpa_forced"] else f"unforced (flash: {r['flash_error']})"
        print(
            f"  {r['size']['name']}: {r['num_params'] / 1e6:.1f}M params, "
            f"{r['size']['rows']} x {r['size']['seq_len']} tokens/step, "
            f"{r['tokens_per_s']:.0f} tokens/s, peak {r['peak_memory_mib']:.0f} MiB "
            f"({r['peak_memory_kind']}), SDPA {kernel}"
        )
        print(f"    attention ops: {', '.join(r['attention_ops'])}")
    b = report["broadcast"]
    if b["status"] == "skipped":
        print(f"  broadcast: skipped ({b['reason']})")
    else:
        print(
            f"  broadcast over {b['backend']}: {b['num_tensors']} tensors, {b['bytes'] / 1e6:.1f} MB"
            f" in {b['send_s']:.3f} s ({b['gb_per_s']:.2f} GB/s), bit-identical: "
            f"{b['bit_identical']}, closed cleanly: {b['closed_cleanly']}"
        )
    print(f"  packages besides torch: {report['third_party_modules'] or 'none'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="CPU, float32, tiny sizes, gloo")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per size")
    parser.add_argument("--out", help="also write the report as JSON here")
    args = parser.parse_args()
    cuda = torch.cuda.is_available() and not args.smoke
    if not cuda and not args.smoke:
        parser.error("no CUDA device: run with --smoke for the CPU check")
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    if cuda:
        torch.cuda.set_device(device)
    init = f"tcp://127.0.0.1:{free_port()}"
    dist.init_process_group("nccl" if cuda else "gloo", init_method=init, rank=0, world_size=1)
    sizes = SMOKE_SIZES if args.smoke else GPU_SIZES
    steps = 1 if args.smoke else args.steps
    report = {
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "dtype": str(dtype).removeprefix("torch."),
        "torch": torch.__version__,
        "smoke": args.smoke,
        "sizes": [checked(size, device, dtype, steps) for size in sizes],
    }
    dist.destroy_process_group()
    report["broadcast"] = check_broadcast(args.smoke)
    report["third_party_modules"] = third_party_modules()
    print_report(report)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
