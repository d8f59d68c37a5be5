"""Factories for the inference integration tests: tiny models, weight dirs, replica processes."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
from replica_support import (  # noqa: F401  (re-exported for the inference tests)
    VLLM_TEST_ARGS,
    Replica,
    inference_command,
    replica_command,
    start_replica,
    wait_until_healthy,
)
from safetensors.torch import load_file, save_file

from rlbus.bus import Bus
from rlbus.checksums import sha256_file
from rlbus.configs.bus import BusConfig
from rlbus.wire.replicas import ReplicaInfo
from rlbus.wire.weights import WeightFile, WeightsPublished

PROMPT = [{"role": "user", "content": "Hi"}]


def replica_bus_args(nats_server, run_id: str) -> list[str]:
    """The `--bus.*` flags that put a replica on `nats_server` under run `run_id`."""
    args = ["--bus.url", nats_server.url, "--bus.run-id", run_id]
    return args + (["--bus.token", nats_server.token] if nats_server.token else [])


async def connect_run(nats_server, run_id: str) -> Bus:
    """A test client on the same run as the replicas started with `replica_bus_args`."""
    config = BusConfig(url=nats_server.url, token=nats_server.token)
    return await Bus.connect(config, run_id=run_id, name="test")


async def registered(bus) -> dict[str, ReplicaInfo]:
    """The replica registry by replica id, read the way the orchestrator and trainer read it."""
    return {info.replica_id: info for info in await bus.read_replicas()}


def make_base_model(out_dir: Path) -> Path:
    from rlbus_trainer.tiny_model import build_tiny_model

    return build_tiny_model(out_dir, seed=0)


def make_changed_weights(
    model_dir: Path, out_dir: Path, *, seed: int = 3, max_shard_bytes: int | None = None
) -> Path:
    """A weights dir whose greedy output clearly differs from the base model's; with
    `max_shard_bytes`, written as the trainer's publisher writes it (streamed shards + index).

    A random tiny model with tied embeddings echoes the last prompt token; scaling the embedding
    and the residual-branch projections makes the layers dominate, so outputs are diverse with
    top-1/top-2 logprob margins >= ~0.02 (far above vLLM-vs-transformers numerical noise).
    """
    from rlbus_trainer.tiny_model import build_tiny_model

    scratch = build_tiny_model(out_dir.with_name(out_dir.name + "-full"), seed=seed)
    tensors = load_file(str(scratch / "model.safetensors"))
    tensors["model.embed_tokens.weight"] *= 5
    for name in tensors:
        if "down_proj" in name or "o_proj" in name:
            tensors[name] *= 100
    out_dir.mkdir(parents=True, exist_ok=True)
    if max_shard_bytes is None:
        save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    else:
        from rlbus.broadcast import TensorSpec
        from rlbus_trainer.safetensors_stream import write_weights

        specs = [TensorSpec.of(n, t) for n, t in tensors.items()]
        write_weights(specs, iter(tensors.items()), out_dir, max_shard_bytes)
    for name in os.listdir(model_dir):  # a full HF dir: config + tokenizer for transformers
        if not name.endswith((".safetensors", ".index.json")):
            shutil.copy(model_dir / name, out_dir / name)
    return out_dir


def make_lora_adapter(
    out_dir: Path,
    *,
    seed: int,
    rank: int = 8,
    hidden: int = 128,
    num_layers: int = 2,
    scale: float = 2.0,
) -> Path:
    """A PEFT-format LoRA adapter on o_proj of every layer with large random weights."""
    import json

    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(num_layers):
        prefix = f"base_model.model.model.layers.{layer}.self_attn.o_proj"
        tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, hidden, generator=gen) * scale
        tensors[f"{prefix}.lora_B.weight"] = torch.randn(hidden, rank, generator=gen) * scale
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "adapter_model.safetensors"), metadata={"format": "pt"})
    (out_dir / "adapter_config.json").write_text(
        json.dumps(
            {
                "peft_type": "LORA",
                "r": rank,
                "lora_alpha": rank,
                "target_modules": ["o_proj"],
                "lora_dropout": 0.0,
                "bias": "none",
                "task_type": "CAUSAL_LM",
            }
        )
    )
    return out_dir


def make_published(version: int, weights_dir: Path, **overrides) -> WeightsPublished:
    files = [
        WeightFile(name=p.name, size=p.stat().st_size, sha256=sha256_file(p))
        for p in sorted(weights_dir.glob("*.safetensors"))
    ]
    fields = dict(version=version, transport="filesystem", location=str(weights_dir), files=files)
    return WeightsPublished(**(fields | overrides))


def transformers_greedy(model_dir: Path, max_tokens: int) -> tuple[list[int], list[float]]:
    """Greedy token ids and their logprobs from transformers for PROMPT."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = tok.apply_chat_template(PROMPT, add_generation_prompt=True, return_tensors="pt")
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    out = model.generate(
        ids,
        max_new_tokens=max_tokens,
        do_sample=False,
        output_scores=True,
        return_dict_in_generate=True,
        pad_token_id=tok.pad_token_id,
    )
    tokens = out.sequences[0, ids.shape[1] :].tolist()
    logprobs = [s[0].log_softmax(-1)[t].item() for s, t in zip(out.scores, tokens, strict=True)]
    return tokens, logprobs
