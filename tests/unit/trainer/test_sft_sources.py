"""SFT data by name (a dataset in a local HF cache, no network), columns, mixtures, fake data."""

import itertools
import json
import re
from collections import Counter

import pytest
from hf_cache_support import HF_VARIABLES_UNSET, cache_dataset, reverse_rows, unreachable_hub
from transformers import AutoTokenizer

from rlbus.configs.sft import ColumnsConfig, SFTConfig, SFTDataConfig
from rlbus_trainer.sft_data import SFTData
from rlbus_trainer.sft_sources import load_conversations, to_conversation

TEXTS = ["alpha", "bravo", "charlie", "delta"]


@pytest.fixture
def hf_home(tmp_path, monkeypatch):
    """An empty HF cache and an unreachable hub, no offline flag (hf_cache_support)."""
    home = tmp_path / "hf"
    for name, value in unreachable_hub(home).items():
        monkeypatch.setenv(name, value)
    for name in HF_VARIABLES_UNSET:
        monkeypatch.delenv(name, raising=False)
    return home


def conversations(**data):
    (source,) = SFTDataConfig(**data).resolved_sources()
    return load_conversations(source)


def test_dataset_by_name_loads_from_the_local_hf_cache_with_the_hub_unreachable(hf_home):
    cache_dataset(hf_home, "acme/reverse", {"default": {"train": reverse_rows(TEXTS)}})
    loaded = conversations(name="acme/reverse")
    assert [c[1]["content"] for c in loaded] == TEXTS
    assert [c[-1] for c in loaded][0] == {"role": "assistant", "content": "ahpla"}


def test_subsets_and_splits_are_read_and_a_wrong_one_is_named(hf_home):
    cache_dataset(
        hf_home,
        "acme/reverse",
        {
            "easy": {"train": reverse_rows(["ab"]), "test": reverse_rows(["cd"])},
            "hard": {"train": reverse_rows(["abcdefgh"])},
        },
    )
    assert conversations(name="acme/reverse", subsets=["hard"])[0][1]["content"] == "abcdefgh"
    test = conversations(name="acme/reverse", subsets=["easy"], splits=["test"])
    assert test[0][1]["content"] == "cd"
    with pytest.raises(ValueError, match=r"^data.subsets: 'medium' is not in 'acme/reverse'"):
        conversations(name="acme/reverse", subsets=["medium"])
    with pytest.raises(ValueError, match=r"^data.splits: 'validation' is not in 'acme/reverse'"):
        conversations(name="acme/reverse", subsets=["easy"], splits=["validation"])


def test_a_dataset_in_no_cache_is_one_line_naming_it_and_how_to_get_it(hf_home):
    with pytest.raises(ValueError) as error:
        conversations(name="acme/missing")
    message = str(error.value)
    assert "\n" not in message and "data.name 'acme/missing'" in message
    assert "hf download --repo-type dataset acme/missing" in message


def test_columns_map_prompt_completion_strings_and_messages():
    columns = ColumnsConfig(prompt_column="question", completion_column="answer")
    assert to_conversation({"question": "2+2?", "answer": "4"}, columns, "t") == [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
    ]
    chat = [
        {"role": "user", "content": "hi", "tool_calls": None},
        {"role": "assistant", "content": "yo"},
    ]
    assert to_conversation({"messages": chat, "question": "x"}, columns, "t") == [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo"},
    ]
    with pytest.raises(ValueError, match="data.prompt_column and data.completion_column"):
        to_conversation({"text": "x"}, columns, "data source 'f.jsonl'")


def test_a_mixture_draws_each_source_by_weight_and_cycles_the_small_one(tiny_model, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    for name, count in (("big", 40), ("small", 3)):
        rows = [{"prompt": f"{name}{i}", "completion": "x"} for i in range(count)]
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = SFTDataConfig(
        sources=[
            {"path": str(tmp_path / "big.jsonl"), "weight": 3.0},
            {"path": str(tmp_path / "small.jsonl"), "weight": 1.0},
        ],
        batch_size=8,
    )
    data = SFTData.from_config(config, tokenizer, seed=1, seq_len=256)
    prompts = [data.conversation(i)[0]["content"] for i in range(400)]
    share = Counter(re.sub(r"\d", "", p) for p in prompts)
    assert 0.65 < share["big"] / 400 < 0.85  # 3:1 (expected 0.75)
    small = [p for p in prompts if p.startswith("small")]
    assert all(
        Counter(small[k : k + 3]) == Counter(["small0", "small1", "small2"])
        for k in range(0, len(small) - 2, 3)
    )  # every epoch of the small source is whole
    again = SFTData.from_config(config, tokenizer, seed=1, seq_len=256)
    assert again.batch(7) == data.batch(7)  # step 7 alone (a resume) draws the same examples


def test_fake_data_is_random_tokens_of_the_configured_shape(tiny_model):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    fixed = SFTData.from_config(
        SFTDataConfig(type="fake", batch_size=3), tokenizer, seed=0, seq_len=64
    )
    batch = fixed.batch(1)
    assert [len(s.input_ids) for s in batch] == [64, 64, 64]
    assert all(s.loss_mask == [0] + [1] * 63 for s in batch)
    assert batch != fixed.batch(2) and batch == fixed.batch(1)
    variable = SFTData.from_config(
        SFTDataConfig(
            type="fake", batch_size=16, fake={"length": "variable", "input_ids": "increasing"}
        ),
        tokenizer,
        seed=0,
        seq_len=64,
    )
    lengths = [len(s.input_ids) for s in variable.batch(1)]
    assert len(set(lengths)) > 1 and max(lengths) <= 64
    ids = variable.batch(1)[0].input_ids
    assert all((b - a) % len(tokenizer) == 1 for a, b in itertools.pairwise(ids))


@pytest.mark.parametrize(
    ("data", "field"),
    [
        ({"name": "a/b", "path": "x.jsonl"}, "data.name"),
        ({"name": "a/b", "subsets": ["x", "y"], "splits": ["t"] * 3}, "data.splits"),
        ({"name": "a/b", "subsets": ["x", "y"], "probabilities": [1.0]}, "data.probabilities"),
        ({"subsets": ["x"]}, "data.subsets"),
        ({"sources": [{"name": "a/b", "path": "x"}]}, "data.sources"),
        ({"sources": [{"path": "x"}], "name": "a/b"}, "data.sources"),
    ],
)
def test_contradicting_data_fields_are_refused_naming_the_field(data, field):
    with pytest.raises(ValueError) as error:
        SFTConfig.model_validate({"data": data})
    assert field.split(".")[1] in str(error.value)
