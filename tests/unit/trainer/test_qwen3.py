"""rlbus's own Qwen3 module (`rlbus_trainer.qwen3`) is transformers' Qwen3ForCausalLM for the
trainer: same logits, same gradients, same parameter names, same training step; models it does
not cover go to transformers."""

import json

import pytest
import torch
from trainer_support import make_train_batch

from rlbus.configs.trainer import TrainerConfig
from rlbus_trainer import qwen3
from rlbus_trainer.attention import Documents, ancestor_mask, block_causal_mask
from rlbus_trainer.engine import build_engine, load_model, setup_distributed
from rlbus_trainer.hf_dir import write_hf_dir
from rlbus_trainer.loss import build_loss_fn
from rlbus_trainer.service import rank_micro_batches
from rlbus_trainer.tiny_model import build_tiny_model


def make_hf_model_dir(path, *, tied: bool, kv_heads: int, seed: int = 0):
    """A Qwen3 checkpoint whose every parameter is random (norm weights too: they start at 1)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        head_dim=32,
        tie_word_embeddings=tied,
        rope_theta=5000.0,
        dtype="float32",
    )
    config.architectures = ["Qwen3ForCausalLM"]
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.3 + (1.0 if p.dim() == 1 else 0.0))
    model.save_pretrained(path, safe_serialization=True)
    return path


def packed_inputs(vocab: int):
    """Two rows: three packed sequences (block-causal), and a shared prompt with two branches."""
    torch.manual_seed(1)
    ids = torch.randint(0, vocab, (2, 12))
    pos = torch.tensor([list(range(5)) + list(range(4)) + list(range(3)), list(range(12))])
    pos[1] = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 5, 6, 7, 8])
    mask = torch.zeros(2, 1, 12, 12, dtype=torch.bool)
    mask[0] = block_causal_mask([5, 4, 3])[0]
    mask[1] = ancestor_mask([-1, 0, 1, 2, 3, 4, 5, 6, 4, 8, 9, 10])[0]
    return ids, pos, mask


def documents_inputs(vocab: int):
    """Three rows padded to 14: four documents; two documents and 3 pads; one document and 4 pads.
    The same rows as `Documents` and as the dense mask of before (a pad attends to itself)."""
    torch.manual_seed(2)
    seq_lens = [[5, 4, 3, 2], [6, 5], [10]]
    ids = torch.randint(0, vocab, (3, 14))
    pos = torch.zeros(3, 14, dtype=torch.long)
    mask = torch.eye(14, dtype=torch.bool).repeat(3, 1, 1, 1)
    for b, lengths in enumerate(seq_lens):
        n = sum(lengths)
        pos[b, :n] = torch.cat([torch.arange(length) for length in lengths])
        mask[b, 0, :n, :n] = block_causal_mask(lengths)[0, 0]
    return ids, pos, Documents.of_rows(seq_lens, 14), mask, [sum(lengths) for lengths in seq_lens]


def logits_and_grads(model, ids, pos, attention, lengths):
    """Logits of the real tokens (pads dropped) and every gradient of a loss over them."""
    model.zero_grad()
    logits = model(input_ids=ids, position_ids=pos, attention_mask=attention).logits
    real = torch.cat([logits[b, :n] for b, n in enumerate(lengths)])  # [sum n, vocab]
    weights = torch.randn(real.shape, generator=torch.Generator().manual_seed(0))
    (real.log_softmax(-1) * weights).sum().backward()
    return real.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("recompute", [False, True])
def test_documents_give_the_dense_mask_and_transformers_logits(tmp_path, recompute):
    path = make_hf_model_dir(tmp_path / "m", tied=False, kv_heads=2)
    ours, theirs = qwen3.load(path, torch.float32), hf_model(path)
    ours.activation_checkpointing = recompute
    ids, pos, documents, mask, lengths = documents_inputs(97)
    new = logits_and_grads(ours, ids, pos, documents, lengths)
    old = logits_and_grads(ours, ids, pos, mask, lengths)
    hf = logits_and_grads(theirs, ids, pos, mask, lengths)
    assert new[0].shape == (sum(lengths), 97)
    for reference in (old, hf):
        torch.testing.assert_close(new[0], reference[0], atol=2e-5, rtol=1e-5)
        for name, grad in reference[1].items():
            torch.testing.assert_close(new[1][name], grad, atol=5e-5, rtol=1e-4)


def hf_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="sdpa"
    )


@pytest.mark.parametrize(("tied", "kv_heads"), [(True, 4), (False, 2)])
def test_rlbus_qwen3_gives_transformers_logits_and_gradients(tmp_path, tied, kv_heads):
    path = make_hf_model_dir(tmp_path / "m", tied=tied, kv_heads=kv_heads)
    ours, theirs = qwen3.load(path, torch.float32), hf_model(path)
    assert isinstance(ours, qwen3.Qwen3ForCausalLM)
    assert sorted(ours.state_dict()) == sorted(theirs.state_dict())
    ids, pos, mask = packed_inputs(97)
    weights = torch.randn(2, 12, 97)
    results = []
    for model in (ours, theirs):
        logits = model(input_ids=ids, position_ids=pos, attention_mask=mask).logits
        (logits.log_softmax(-1) * weights).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        results.append((logits.detach(), grads))
    (our_logits, our_grads), (hf_logits, hf_grads) = results
    assert our_logits.shape == (2, 12, 97)
    torch.testing.assert_close(our_logits, hf_logits, atol=2e-5, rtol=1e-5)
    assert sorted(our_grads) == sorted(hf_grads)
    for name in hf_grads:
        torch.testing.assert_close(our_grads[name], hf_grads[name], atol=5e-5, rtol=1e-4)


def test_a_tied_head_stays_tied_to_the_embeddings(tmp_path):
    model = qwen3.load(make_hf_model_dir(tmp_path / "m", tied=True, kv_heads=4), torch.float32)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.config.tie_word_embeddings and model.config.vocab_size == 97
    assert model.get_input_embeddings() is model.model.embed_tokens


def test_activation_checkpointing_changes_no_gradient(tmp_path):
    path = make_hf_model_dir(tmp_path / "m", tied=True, kv_heads=4)
    ids, pos, mask = packed_inputs(97)
    grads = []
    for recompute in (False, True):
        model = qwen3.load(path, torch.float32)
        model.activation_checkpointing = recompute
        model(input_ids=ids, position_ids=pos, attention_mask=mask).logits.sum().backward()
        grads.append(model.model.layers[0].mlp.up_proj.weight.grad)
    torch.testing.assert_close(grads[0], grads[1])


@pytest.mark.parametrize(
    "change",
    [
        {"architectures": ["LlamaForCausalLM"]},
        {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}},
        {"rope_scaling": {"type": "linear", "factor": 2.0}},
        {"use_sliding_window": True},
        {"layer_types": ["full_attention", "sliding_attention"]},
        {"attention_bias": True},
        {"hidden_act": "gelu"},
    ],
)
def test_models_rlbus_does_not_cover_are_left_to_transformers(tmp_path, change):
    path = make_hf_model_dir(tmp_path / "m", tied=True, kv_heads=4)
    config = json.loads((path / "config.json").read_text())
    assert qwen3.read_config(config) is not None
    (path / "config.json").write_text(json.dumps({**config, **change}))
    assert qwen3.load(path, torch.float32) is None


def test_engine_picks_the_implementation_by_model_impl(tmp_path):
    path = build_tiny_model(tmp_path / "tiny", seed=0)
    auto = load_model(TrainerConfig(model={"name": str(path)}).model, torch.device("cpu"))
    assert isinstance(auto, qwen3.Qwen3ForCausalLM)
    forced = TrainerConfig(model={"name": str(path), "impl": "transformers"}).model
    assert type(load_model(forced, torch.device("cpu"))).__module__.startswith("transformers")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "use_sliding_window": True}))
    strict = TrainerConfig(model={"name": str(path), "impl": "rlbus"}).model
    with pytest.raises(ValueError, match="model.impl = 'rlbus' covers"):
        load_model(strict, torch.device("cpu"))


def test_a_training_step_is_the_same_with_either_implementation(tiny_model):
    batch = make_train_batch(1, num_sequences=6, seed=3)
    results = []
    for impl in ("rlbus", "transformers"):
        config = TrainerConfig(
            model={"name": str(tiny_model), "impl": impl},
            optim={"type": "sgd", "lr": 1.0, "max_norm": None},
        )
        engine = build_engine(config, setup_distributed())
        result = engine.train_step(rank_micro_batches(batch, 0, 1), build_loss_fn(config.loss))
        weights = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
        results.append((result, weights))
    (ours, our_weights), (theirs, their_weights) = results
    assert ours.loss == pytest.approx(theirs.loss, abs=1e-6)
    assert ours.grad_norm == pytest.approx(theirs.grad_norm, rel=1e-4)
    assert sorted(our_weights) == sorted(their_weights)
    for name in their_weights:
        torch.testing.assert_close(our_weights[name], their_weights[name], atol=1e-5, rtol=1e-4)


def test_written_model_directories_carry_the_source_files_as_they_are(tiny_model, tmp_path):
    model = qwen3.load(tiny_model, torch.float32)
    out = write_hf_dir(model.state_dict(), str(tiny_model), tmp_path / "step_1")
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (out / name).read_bytes() == (tiny_model / name).read_bytes()
    reloaded = hf_model(out)  # what vLLM and transformers load
    ids, pos, mask = packed_inputs(300)
    with torch.no_grad():
        torch.testing.assert_close(
            reloaded(input_ids=ids, position_ids=pos, attention_mask=mask).logits,
            model(input_ids=ids, position_ids=pos, attention_mask=mask).logits,
        )
