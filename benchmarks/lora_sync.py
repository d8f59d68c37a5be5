"""Bytes moved per weight sync: a LoRA adapter vs the full weights, side by side.

    uv run python benchmarks/lora_sync.py [--model examples/reverse-text/model] [--rank 8]

Measured for `--model` (a local Qwen3 checkpoint, the debug model by default): the trainer's
own publishers' writers produce both directories (`lora.write_adapter_dir` with the default
target modules, `hf_dir.write_hf_dir`), and the bytes of their safetensors files (what a replica
reads per sync) and the time to write them are printed. Then the same count by formula for
bigger Qwen3 models, whose shapes are written below (from their config.json):

    full    = V*h (x2 if untied) + L*(h*d*(2H + 2K) + 3*h*I + 2h + 2d) + h      parameters
    adapter = L * r * sum over targets of (in + out)                               parameters
            = L * r * (q: h + H*d, k: h + K*d, v: h + K*d, o: H*d + h, gate/up: h + I, down: I + h)

(h hidden, I intermediate, L layers, H/K query/kv heads, d head_dim, V vocab, r rank.) The
formula is checked against the measured debug model before the table is printed.
"""

import argparse
import tempfile
import time
from pathlib import Path

import torch

from rlbus.configs.trainer import LoRAConfig, TrainerModelConfig
from rlbus_trainer.engine import load_model
from rlbus_trainer.hf_dir import write_hf_dir
from rlbus_trainer.lora import adapter_state_dict, apply_lora, write_adapter_dir

QWEN3 = {  # name: (h, I, L, H, K, d, V, tied)
    "Qwen3-0.6B": (1024, 3072, 28, 16, 8, 128, 151936, True),
    "Qwen3-1.7B": (2048, 6144, 28, 16, 8, 128, 151936, True),
    "Qwen3-4B": (2560, 9728, 36, 32, 8, 128, 151936, True),
    "Qwen3-8B": (4096, 12288, 36, 32, 8, 128, 151936, False),
    "Qwen3-32B": (5120, 25600, 64, 64, 8, 128, 151936, False),
}


def full_params(h, inter, layers, heads, kv, d, vocab, tied) -> int:
    per_layer = h * d * (2 * heads + 2 * kv) + 3 * h * inter + 2 * h + 2 * d
    return vocab * h * (1 if tied else 2) + layers * per_layer + h


def adapter_params(h, inter, layers, heads, kv, d, rank, targets) -> int:
    sizes = {
        "q_proj": h + heads * d,
        "k_proj": h + kv * d,
        "v_proj": h + kv * d,
        "o_proj": heads * d + h,
        "gate_proj": h + inter,
        "up_proj": h + inter,
        "down_proj": inter + h,
    }
    return layers * rank * sum(sizes[t] for t in targets)


def shape_of(config) -> tuple:
    c = config
    return (
        c.hidden_size,
        c.intermediate_size,
        c.num_hidden_layers,
        c.num_attention_heads,
        c.num_key_value_heads,
        c.head_dim,
        c.vocab_size,
        c.tie_word_embeddings,
    )


def safetensors_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.glob("*.safetensors"))


def measure(model_dir: str, lora: LoRAConfig) -> dict:
    model = load_model(TrainerModelConfig(name=model_dir, impl="rlbus"), torch.device("cpu"))
    apply_lora(model, lora)
    state = {k: v.detach() for k, v in model.state_dict().items()}
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        adapter = write_adapter_dir(adapter_state_dict(state), lora, model_dir, Path(tmp) / "a")
        t1 = time.perf_counter()
        base = {k: v for k, v in state.items() if ".lora_" not in k}
        full = write_hf_dir(base, model_dir, Path(tmp) / "full")
        t2 = time.perf_counter()
        return {
            "shape": shape_of(model.config),
            "adapter_bytes": safetensors_bytes(adapter),
            "full_bytes": safetensors_bytes(full),
            "adapter_write_s": t1 - t0,
            "full_write_s": t2 - t1,
            "bytes_per_param": next(iter(base.values())).element_size(),
        }


def row(name: str, adapter: float, full: float, unit: str = "MB") -> str:
    scale = 1e6 if unit == "MB" else 1
    return f"{name:<30} {adapter / scale:>14.3f} {full / scale:>14.3f} {full / adapter:>10.1f}x"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="examples/reverse-text/model")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--bytes-per-param", type=int, default=2, help="of the formula rows")
    args = parser.parse_args()
    lora = LoRAConfig(rank=args.rank, alpha=2.0 * args.rank)
    m = measure(args.model, lora)
    h, inter, layers, heads, kv, d, vocab, tied = m["shape"]
    n_full = full_params(*m["shape"])
    n_adapter = adapter_params(h, inter, layers, heads, kv, d, args.rank, lora.target_modules)
    per = m["bytes_per_param"]
    label = "/".join(Path(args.model).parts[-2:])
    # safetensors adds a JSON header per file: the formula counts payload bytes only.
    assert abs(n_adapter * per - m["adapter_bytes"]) < 64 * 1024, (n_adapter * per, m)
    assert abs(n_full * per - m["full_bytes"]) < 64 * 1024, (n_full * per, m)

    print(f"LoRA rank {args.rank} on {', '.join(lora.target_modules)}\n")
    print(f"{'model':<30} {'adapter MB':>14} {'full MB':>14} {'full/adapter':>11}")
    print(row(f"{label} (measured)", m["adapter_bytes"], m["full_bytes"]))
    print(
        f"{'  write time (s)':<30} {m['adapter_write_s']:>14.4f} {m['full_write_s']:>14.4f} "
        f"{m['full_write_s'] / m['adapter_write_s']:>10.1f}x"
    )
    print(row(f"{label} (formula)", n_adapter * per, n_full * per))
    print(f"\nformula, {args.bytes_per_param} bytes a parameter (bf16):")
    for name, (h, inter, layers, heads, kv, d, vocab, tied) in QWEN3.items():
        full = full_params(h, inter, layers, heads, kv, d, vocab, tied)
        adapter = adapter_params(h, inter, layers, heads, kv, d, args.rank, lora.target_modules)
        print(row(name, adapter * args.bytes_per_param, full * args.bytes_per_param))


if __name__ == "__main__":
    main()
