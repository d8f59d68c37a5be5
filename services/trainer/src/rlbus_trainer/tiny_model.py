"""Build a tiny Qwen3 model directory offline (`rlbus-tiny-model OUT_DIR [--seed N]`).

No model hub is reachable in our tests, CI or examples, so every service tests against a model
this module builds from nothing: a Qwen3ForCausalLM with tied embeddings and a byte-level
tokenizer (256 byte tokens, no merges) plus the ChatML special tokens and a ChatML chat template,
so that both transformers' `apply_chat_template` and vLLM's chat endpoint work.

The default sizes (hidden 128, 2 layers, 4 heads x head_dim 32, FFN 384, vocab 300) are the ones
that learned reverse-text fastest on 2 CPU cores (docs/facts.md); head_dim >= 32 because
vLLM's CPU attention kernel rejects 16. The same seed gives byte-identical safetensors.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
PAD = "<|endoftext|>"
SPECIAL_TOKENS = [PAD, IM_START, IM_END]

# ChatML, as Qwen models use it (without tool or thinking blocks).
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def _bytes_to_unicode() -> dict[int, str]:
    """The byte -> printable character table of byte-level BPE (the ByteLevel pre-tokenizer's)."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def build_tokenizer() -> Tokenizer:
    """A byte-level BPE tokenizer without merges: token id = byte value, then the special tokens."""
    vocab = {char: byte for byte, char in _bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    return tok


def build_tiny_model(
    out_dir: Path,
    *,
    seed: int = 0,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    head_dim: int = 32,
    num_kv_heads: int = 4,
    intermediate_size: int = 384,
    vocab_size: int = 300,
    max_position_embeddings: int = 2048,
) -> Path:
    """Write a tiny Qwen3 HF model directory (weights, config, tokenizer, chat template) to out_dir."""
    # torch and transformers are imported here, not at the top: `rlbus-tiny-model --help` stays
    # instant (they cost seconds to import).
    import torch
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=build_tokenizer(),
        eos_token=IM_END,
        pad_token=PAD,
        additional_special_tokens=[IM_START, IM_END],
        chat_template=CHAT_TEMPLATE,
        model_max_length=max_position_embeddings,
    )
    assert len(tokenizer) <= vocab_size, f"vocab_size must be >= {len(tokenizer)}"
    ids = tokenizer.convert_tokens_to_ids([IM_END, PAD])
    assert isinstance(ids, list)  # a list of tokens gives a list of ids
    eos_id, pad_id = ids
    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        dtype="float32",
    )
    config.architectures = ["Qwen3ForCausalLM"]
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config)
    model.generation_config.eos_token_id = eos_id
    model.generation_config.pad_token_id = pad_id
    model.generation_config.bos_token_id = None
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    _ensure_chat_template_in_config(out_dir)
    return out_dir


def _ensure_chat_template_in_config(out_dir: Path) -> None:
    """Keep the template inside tokenizer_config.json too (older readers look only there), and
    name the generic fast tokenizer class, which transformers 4.x and 5.x both resolve."""
    path = out_dir / "tokenizer_config.json"
    cfg = json.loads(path.read_text())
    cfg["chat_template"] = CHAT_TEMPLATE
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="rlbus-tiny-model",
        description="Build a tiny Qwen3 model directory offline (byte-level tokenizer, ChatML).",
    )
    parser.add_argument("out_dir", type=Path, help="directory to write the model to")
    parser.add_argument("--seed", type=int, default=0, help="weight init seed (default 0)")
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--num-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--num-kv-heads", type=int, default=4)
    parser.add_argument("--intermediate-size", type=int, default=384)
    args = parser.parse_args(argv)
    path = build_tiny_model(
        args.out_dir,
        seed=args.seed,
        hidden_size=args.hidden_size,
        num_layers=args.num_layers,
        num_heads=args.num_heads,
        head_dim=args.head_dim,
        num_kv_heads=args.num_kv_heads,
        intermediate_size=args.intermediate_size,
    )
    print(path)


if __name__ == "__main__":
    main()
