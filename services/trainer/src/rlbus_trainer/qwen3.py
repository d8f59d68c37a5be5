"""Qwen3 causal LM in plain torch: the trainer's model without importing transformers.

Importing transformers' model classes costs ~3 s of one core (torch._dynamo, DTensor, version
checks; docs/trainer.md, "Model implementation"), which is most of a trainer's start-up. This
module is the same network as transformers' `Qwen3ForCausalLM` for what the trainer does with
it (training forward with packed rows: position ids and the rows' attention), with the same
parameter names, so checkpoints, weight broadcasts and vLLM see no difference. The attention is
a `Documents` layout (per-document causal SDPA, no [T, T] tensor) or a dense bool mask
(`rlbus_trainer/attention.py`).
`tests/unit/trainer/test_qwen3.py` checks logits and gradients against transformers.

    load(model_dir, dtype) -> Qwen3ForCausalLM | None     None: not a model this module covers
    model(input_ids, position_ids, attention_mask).logits  [B, T, vocab]
                                  attention_mask: Documents or bool [B, 1, T, T]

Covered: `Qwen3ForCausalLM` configs with default RoPE, full attention in every layer, no
attention bias. Anything else (rope scaling, sliding windows, other architectures) returns None
and the trainer loads it with transformers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from rlbus_trainer.attention import AttentionLayout, Documents, document_attention

ARCHITECTURE = "Qwen3ForCausalLM"


@dataclass
class Qwen3Config:
    """The config.json fields the network needs (names as transformers spells them)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool


def read_config(raw: dict[str, Any]) -> Qwen3Config | None:
    """The config of a config.json this module covers, else None (see module docstring)."""
    if raw.get("architectures") != [ARCHITECTURE] or raw.get("attention_bias", False):
        return None
    if raw.get("hidden_act", "silu") != "silu" or raw.get("use_sliding_window", False):
        return None
    if any(kind != "full_attention" for kind in raw.get("layer_types") or []):
        return None
    rope = raw.get("rope_parameters") or {}  # transformers 5; 4.x: rope_theta + rope_scaling
    if rope.get("rope_type", "default") != "default" or raw.get("rope_scaling"):
        return None
    heads = raw["num_attention_heads"]
    return Qwen3Config(
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        num_hidden_layers=raw["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=raw.get("num_key_value_heads") or heads,
        head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        rope_theta=rope.get("rope_theta", raw.get("rope_theta", 10000.0)),
        tie_word_embeddings=raw.get("tie_word_embeddings", False),
    )


class Linear(nn.Linear):
    """nn.Linear without its random init: `load` assigns every weight from the checkpoint. (The
    init would cost time on a big model, and on the meta device it imports torch._dynamo: 1.4 s.)"""

    def reset_parameters(self) -> None:
        pass


class Embedding(nn.Embedding):
    """nn.Embedding without its random init (see Linear)."""

    def reset_parameters(self) -> None:
        pass


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # In float32, scaled back to the input dtype before the weight (as transformers does).
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_cos_sin(
    config: Qwen3Config, position_ids: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotary angles, [B, 1, T, head_dim] each (float32 math, then dtype)."""
    dim = config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=position_ids.device).float()
    inv_freq = 1.0 / (config.rope_theta ** (exponents / dim))  # [dim / 2]
    freqs = position_ids[..., None].float() * inv_freq  # [B, T, dim / 2]
    angles = torch.cat((freqs, freqs), dim=-1)[:, None]  # [B, 1, T, dim]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        d, h, kv = config.head_dim, config.num_attention_heads, config.num_key_value_heads
        self.head_dim, self.num_groups = d, h // kv
        self.q_proj = Linear(config.hidden_size, h * d, bias=False)
        self.k_proj = Linear(config.hidden_size, kv * d, bias=False)
        self.v_proj = Linear(config.hidden_size, kv * d, bias=False)
        self.o_proj = Linear(h * d, config.hidden_size, bias=False)
        self.q_norm = RMSNorm(d, config.rms_norm_eps)  # per head, before RoPE
        self.k_norm = RMSNorm(d, config.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attention: AttentionLayout
    ) -> torch.Tensor:
        b, t, _ = x.shape
        heads = (b, t, -1, self.head_dim)
        q = self.q_norm(self.q_proj(x).view(heads)).transpose(1, 2)  # [B, H, T, D]
        k = self.k_norm(self.k_proj(x).view(heads)).transpose(1, 2)  # [B, KV, T, D]
        v = self.v_proj(x).view(heads).transpose(1, 2)  # [B, KV, T, D]
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        if self.num_groups > 1:
            k = k.repeat_interleave(self.num_groups, dim=1)
            v = v.repeat_interleave(self.num_groups, dim=1)
        scale = self.head_dim**-0.5
        if isinstance(attention, Documents):
            out = document_attention(q, k, v, attention, scale)  # [B, H, T, D]
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention, scale=scale)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        self.gate_proj = Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attention: AttentionLayout
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attention)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3Model(nn.Module):
    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class CausalLMOutput(NamedTuple):
    logits: torch.Tensor


class Qwen3ForCausalLM(nn.Module):
    """`model.*` and `lm_head` as in transformers; `config` carries `tie_word_embeddings` and
    `vocab_size`, and `get_input_embeddings` answers, as on a transformers model (what the
    trainer reads of one)."""

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        self.config = config
        self.model = Qwen3Model(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.activation_checkpointing = False

    def get_input_embeddings(self) -> nn.Embedding:
        """As transformers names it (the trainer bounds token ids by its rows)."""
        return self.model.embed_tokens

    def forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: AttentionLayout
    ) -> CausalLMOutput:
        """input_ids, position_ids: [B, T]; attention_mask: the rows' `Documents`, or a bool
        [B, 1, T, T] mask, True = attend (named as transformers names its mask argument, so the
        engine calls both models alike)."""
        x = self.model.embed_tokens(input_ids)  # [B, T, hidden]
        cos, sin = rope_cos_sin(self.config, position_ids, x.dtype)
        for layer in self.model.layers:
            if self.activation_checkpointing and self.training:
                x = checkpoint(layer, x, cos, sin, attention_mask, use_reentrant=False)
            else:
                x = layer(x, cos, sin, attention_mask)
        return CausalLMOutput(self.lm_head(self.model.norm(x)))  # [B, T, vocab]


def random_model(
    config: Qwen3Config, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> Qwen3ForCausalLM:
    """A model of `config` with random weights (normal, std 0.02; norms at 1), seeded from torch's
    global generator: for benchmarks and checks that need a model of a given size, no file."""
    with torch.device(device):
        model = Qwen3ForCausalLM(config).to(dtype)
    with torch.no_grad():  # the module's Linear layers skip their init (weights come from files)
        for p in model.parameters():
            p.normal_(0.0, 0.02) if p.dim() > 1 else p.fill_(1.0)
    return model


def read_weights(model_dir: Path) -> dict[str, torch.Tensor] | None:
    """Every tensor of the directory's safetensors (one file or an index of shards)."""
    # Imported here: benchmarks/gpu_check.py builds this module on a machine with torch alone.
    from safetensors.torch import load_file

    from rlbus_trainer.hf_dir import WEIGHTS_FILE, WEIGHTS_INDEX

    if (model_dir / WEIGHTS_FILE).is_file():
        return load_file(model_dir / WEIGHTS_FILE)
    if not (model_dir / WEIGHTS_INDEX).is_file():
        return None
    shards = sorted(set(json.loads((model_dir / WEIGHTS_INDEX).read_text())["weight_map"].values()))
    return {name: t for shard in shards for name, t in load_file(model_dir / shard).items()}


def load(model_dir: Path, dtype: torch.dtype) -> Qwen3ForCausalLM | None:
    """The model in `model_dir` in `dtype`, or None when this module does not cover it."""
    config_file = model_dir / "config.json"
    if not config_file.is_file():
        return None
    config = read_config(json.loads(config_file.read_text()))
    weights = read_weights(model_dir) if config is not None else None
    if config is None or weights is None:
        return None
    model = Qwen3ForCausalLM(config)  # uninitialised: every parameter comes from the file
    if config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    weights = {name: t.to(dtype) for name, t in weights.items()}
    missing, unexpected = model.load_state_dict(weights, strict=False, assign=True)
    expected_missing = ["lm_head.weight"] if config.tie_word_embeddings else []
    if sorted(missing) != expected_missing or unexpected:
        raise ValueError(
            f"model.name: {model_dir} does not hold a {ARCHITECTURE} checkpoint "
            f"(missing {sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]})"
        )
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model
