"""The tiny model every service tests against: builds offline, reloads, renders ChatML, is deterministic."""

import pytest

from rlbus.checksums import sha256_file
from rlbus_trainer.tiny_model import IM_END, build_tiny_model


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


def test_tiny_model_reloads_offline_with_auto_classes(tiny_model_dir, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert model.config.head_dim >= 32
    assert model.config.tie_word_embeddings
    assert len(tokenizer) <= model.config.vocab_size
    assert tokenizer.eos_token == IM_END
    assert model.config.eos_token_id == tokenizer.eos_token_id


def test_tiny_model_chat_template_renders_chatml_and_round_trips(tiny_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    messages = [
        {"role": "user", "content": "Reverse: héllo"},
        {"role": "assistant", "content": "olléh"},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    assert (
        text
        == "<|im_start|>user\nReverse: héllo<|im_end|>\n<|im_start|>assistant\nolléh<|im_end|>\n"
    )
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text
    prompt = tokenizer.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n")


def test_tiny_model_is_deterministic_given_seed(tiny_model_dir, tmp_path):
    same = build_tiny_model(tmp_path / "same", seed=0)
    other = build_tiny_model(tmp_path / "other", seed=1)
    ref = sha256_file(tiny_model_dir / "model.safetensors")
    assert sha256_file(same / "model.safetensors") == ref
    assert sha256_file(other / "model.safetensors") != ref


def test_tiny_model_cli_writes_directory(tmp_path):
    from rlbus_trainer.tiny_model import main

    main([str(tmp_path / "m"), "--seed", "3"])
    assert (tmp_path / "m" / "model.safetensors").exists()
    assert (tmp_path / "m" / "tokenizer.json").exists()
