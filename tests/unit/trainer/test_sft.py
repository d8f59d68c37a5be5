"""SFT: tokenization masks, packing, a short in-process run whose loss falls and whose model loads."""

from trainer_support import make_sft_config, read_metrics
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlbus.configs.sft import SFTConfig, SFTDataConfig
from rlbus_trainer.sft_data import SFTData, pack, tokenize_conversation


def sft_data(tokenizer, *, seed=0, seq_len=512, **data):
    """The SFT data an `sft` run with `[data]` = `data` trains on."""
    return SFTData.from_config(SFTDataConfig(**data), tokenizer, seed=seed, seq_len=seq_len)


def test_loss_mask_covers_assistant_content_and_end_token_only(tiny_model):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    messages = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "abc"},
        {"role": "assistant", "content": "cba"},
    ]
    tok = tokenize_conversation(tokenizer, messages, ["assistant"])
    assert tokenizer.decode(tok.input_ids) == tokenizer.apply_chat_template(
        messages, tokenize=False
    )
    trained = tokenizer.decode([t for t, m in zip(tok.input_ids, tok.loss_mask, strict=True) if m])
    assert trained == "cba<|im_end|>\n"


def test_packing_keeps_every_token_and_restarts_positions(tiny_model):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    samples = sft_data(tokenizer, batch_size=10).batch(1)
    rows = pack(samples, seq_len=200)
    assert sum(len(r.input_ids) for r in rows) == sum(len(s.input_ids) for s in samples)
    assert all(len(r.input_ids) <= 200 for r in rows) and len(rows) < len(samples)
    row = rows[0]
    assert row.position_ids[row.seq_lens[0]] == 0 and len(row.seq_lens) > 1


def test_sft_data_is_deterministic_per_step(tiny_model):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    a = sft_data(tokenizer, batch_size=4)
    b = sft_data(tokenizer, batch_size=4)
    assert a.batch(3) == b.batch(3) and a.batch(3) != a.batch(4)


def test_copy_fraction_mixes_copied_answers_into_the_same_texts():
    import random

    from rlbus_trainer.sft_data import reverse_text_conversation

    def answers(copy_fraction):
        convs = [
            reverse_text_conversation(random.Random(i), copy_fraction=copy_fraction)
            for i in range(400)
        ]
        return [(c[1]["content"], c[2]["content"]) for c in convs]

    clean, mixed = answers(0.0), answers(0.4)
    assert all(a == t[::-1] for t, a in clean)
    assert [t for t, _ in clean] == [t for t, _ in mixed]  # same texts: only the answers change
    copied = sum(a == t and t != t[::-1] for t, a in mixed)
    assert 0.3 * 400 < copied < 0.5 * 400


def test_copy_fraction_is_refused_for_files():
    import pytest

    with pytest.raises(ValueError, match="copy_fraction"):
        SFTConfig.model_validate({"data": {"path": "train.jsonl", "copy_fraction": 0.4}})


def test_sft_jsonl_run_loss_falls_and_writes_loadable_model(tiny_model, tmp_path):
    from rlbus_trainer.sft import run

    data = tmp_path / "train.jsonl"
    import json

    with open(data, "w") as f:
        for text in ["hello", "world", "abcdef", "reverse"] * 4:
            f.write(
                json.dumps(
                    {
                        "messages": [
                            {"role": "user", "content": text},
                            {"role": "assistant", "content": text[::-1]},
                        ]
                    }
                )
                + "\n"
            )
    config = SFTConfig.model_validate(
        make_sft_config(
            tiny_model,
            tmp_path / "out",
            "jsonl",
            max_steps=8,
            data={"path": str(data), "batch_size": 8, "val_path": str(data), "val_interval": 8},
        )
    )
    out = run(config)
    metrics = read_metrics(tmp_path / "out" / "jsonl")
    assert [m["step"] for m in metrics] == list(range(1, 9))
    assert metrics[-1]["loss"] < metrics[0]["loss"] - 0.5
    assert "val_loss" in metrics[-1]
    model = AutoModelForCausalLM.from_pretrained(out)
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert AutoTokenizer.from_pretrained(out).chat_template


def test_sft_reads_parquet_messages(tiny_model, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [
        [{"role": "user", "content": t}, {"role": "assistant", "content": t[::-1]}]
        for t in ("abc", "hello")
    ]
    pq.write_table(pa.table({"messages": rows}), tmp_path / "train.parquet")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    data = sft_data(tokenizer, path=str(tmp_path / "train.parquet"), batch_size=2)
    assert data.num_examples == 2
    texts = sorted(tokenizer.decode(s.input_ids) for s in data.batch(1))
    assert texts[0].endswith("<|im_start|>assistant\ncba<|im_end|>\n")


def test_sft_data_visits_every_example_once_per_epoch_each_epoch_in_its_own_order(
    tiny_model, tmp_path
):
    import json
    import random

    path = tmp_path / "train.jsonl"
    rows = [
        [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "a"}]
        for i in range(7)
    ]
    path.write_text("".join(json.dumps({"messages": r}) + "\n" for r in rows))
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    data = sft_data(tokenizer, path=str(path), batch_size=3, seed=5)
    seen = [data.conversation(i)[0]["content"] for i in range(21)]  # three epochs, any order
    epochs = [seen[0:7], seen[7:14], seen[14:21]]
    assert all(sorted(e) == sorted(f"q{i}" for i in range(7)) for e in epochs)
    assert len({tuple(e) for e in epochs}) == 3
    # the documented order: epoch e is `range(n)` shuffled by Random("sft/<seed>/<e>")
    order = list(range(7))
    random.Random("sft/5/1").shuffle(order)
    assert epochs[1] == [f"q{i}" for i in order]
    assert data.conversation(3) == rows[data.epoch_order(0)[3]]  # back to an earlier epoch


def test_sft_data_path_errors_name_the_field(tiny_model, tmp_path):
    import pytest

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    with pytest.raises(ValueError, match="data.path"):
        sft_data(tokenizer, path=str(tmp_path / "missing.jsonl"), batch_size=2)


def test_full_offload_sft_checkpoints_and_resumes(tiny_model, tmp_path):
    from rlbus_trainer.ckpt import complete_steps
    from rlbus_trainer.sft import run

    base = make_sft_config(
        tiny_model,
        tmp_path / "out",
        "offload",
        max_steps=2,
        ckpt={"interval": 1},
        model={"name": str(tiny_model), "optim_cpu_offload": False, "full_offload": True},
        save_final_model=False,
    )
    run(SFTConfig.model_validate(base))
    assert complete_steps(tmp_path / "out" / "offload") == [1, 2]
    run(SFTConfig.model_validate({**base, "max_steps": 3, "resume": {}}))
    metrics = read_metrics(tmp_path / "out" / "offload")
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert metrics[2]["loss"] < metrics[0]["loss"]


class FakeWandb:
    """Stands in for the wandb package (not installed here): records what the sink sends."""

    def __init__(self):
        self.init_kwargs: dict = {}
        self.logged: list[tuple[dict, int]] = []
        self.finished = False

    def init(self, **kwargs):
        self.init_kwargs = kwargs
        return self

    def log(self, values, step):
        self.logged.append((values, step))

    def define_metric(self, name, step_metric):
        self.defined = (name, step_metric)

    def finish(self):
        self.finished = True


def test_sft_logs_every_step_to_wandb_when_monitors_wandb_is_set(tiny_model, tmp_path, monkeypatch):
    import sys

    from rlbus_trainer.sft import run

    wandb = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    config = SFTConfig.model_validate(
        make_sft_config(
            tiny_model,
            tmp_path / "out",
            "wb",
            max_steps=2,
            save_final_model=False,
            monitors={"wandb": {"project": "p", "offline": True, "tags": ["t"]}},
        )
    )

    run(config)

    assert wandb.init_kwargs["project"] == "p" and wandb.init_kwargs["mode"] == "offline"
    assert wandb.init_kwargs["name"] == "wb" and wandb.init_kwargs["tags"] == ["t"]
    assert [step for _, step in wandb.logged] == [1, 2]
    assert all("loss" in values for values, _ in wandb.logged) and wandb.finished
    assert [m["step"] for m in read_metrics(tmp_path / "out" / "wb")] == [1, 2]  # file sink too
