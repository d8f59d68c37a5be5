"""Peak memory of one training step (forward + backward) of rlbus's Qwen3 module on CPU, with the
dense [B, 1, T, T] mask of before and with the `Documents` layout (rlbus_trainer/attention.py).

    ./uvw run python benchmarks/attention_memory.py [--seq-lens 4096,16384] [--documents 4]
        [--hidden 256 --layers 2 --heads 4 --head-dim 64 --vocab 1024]

Each case runs in a subprocess of its own, so one case's peak cannot hide another's: the child
builds a random-init model (no files), one row of `seq_len` tokens packed with `--documents`
equal documents, then runs one step and reports its own peak RSS (`resource.getrusage(
RUSAGE_SELF).ru_maxrss`, the kernel's high-water mark of the process) and its RSS before the
step, whose difference is what the step itself added. The dense case builds its mask inside the
step, as the engine did. Both layouts run in the same invocation; the table shows them side by
side with the ratio.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys


def model_of(args: argparse.Namespace):
    import torch

    from rlbus_trainer import qwen3

    config = qwen3.Qwen3Config(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=3 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        head_dim=args.head_dim,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    return qwen3.random_model(config)


def run_case(args: argparse.Namespace) -> dict[str, float]:
    """One step of one layout (the child process); RSS figures in MiB."""
    import torch

    from rlbus_trainer.attention import Documents, block_causal_mask

    torch.set_num_threads(args.threads)
    model = model_of(args)
    t = args.seq_len
    seq_lens = [t // args.documents] * args.documents
    seq_lens[-1] += t - sum(seq_lens)
    ids = torch.randint(0, args.vocab, (1, t))
    pos = torch.cat([torch.arange(n) for n in seq_lens])[None]
    before = rss_mib()
    dense = args.case == "dense"
    attention = block_causal_mask(seq_lens) if dense else Documents.of_rows([seq_lens], t)
    logits = model(input_ids=ids, position_ids=pos, attention_mask=attention).logits
    logits.float().log_softmax(-1).mean().backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"rss_before_mib": before, "peak_rss_mib": peak, "step_mib": peak - before}


def rss_mib() -> float:
    """The process's resident set now (Linux /proc), in MiB."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def child_result(args: argparse.Namespace, case: str, seq_len: int) -> dict[str, float]:
    cmd = [sys.executable, __file__, "--case", case, "--seq-len", str(seq_len)]
    for flag in ("documents", "hidden", "layers", "heads", "head_dim", "vocab", "threads"):
        cmd += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.splitlines()[-1])


def report(args: argparse.Namespace) -> None:
    print(
        f"model: hidden {args.hidden}, {args.layers} layers, {args.heads} heads x {args.head_dim},"
        f" vocab {args.vocab}; one row of {args.documents} documents; {args.threads} threads"
    )
    print(
        f"{'seq_len':>8} {'dense peak':>11} {'docs peak':>10} {'dense step':>11} "
        f"{'docs step':>10} {'step ratio':>11}   (MiB; step = peak - RSS before)"
    )
    for seq_len in [int(s) for s in args.seq_lens.split(",")]:
        dense = child_result(args, "dense", seq_len)
        docs = child_result(args, "documents", seq_len)
        ratio = dense["step_mib"] / docs["step_mib"]
        print(
            f"{seq_len:>8} {dense['peak_rss_mib']:>11.0f} {docs['peak_rss_mib']:>10.0f} "
            f"{dense['step_mib']:>11.0f} {docs['step_mib']:>10.0f} {ratio:>10.1f}x",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-lens", default="4096,16384")
    parser.add_argument("--documents", type=int, default=4, help="documents packed in the row")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--case", choices=["dense", "documents"], help="(child process) one case")
    parser.add_argument("--seq-len", type=int, help="(child process) its seq_len")
    args = parser.parse_args()
    if args.case:
        print(json.dumps(run_case(args)))
    else:
        report(args)


if __name__ == "__main__":
    main()
