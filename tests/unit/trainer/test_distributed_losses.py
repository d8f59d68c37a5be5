"""Per-sample losses and the reference KL over 2 FSDP2 ranks (gloo) give the step of 1 rank: the
step's sample count is all-reduced like its token count, and a LoRA reference (adapters off)
works on sharded modules."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent(
    """
    import json, sys
    sys.path.insert(0, sys.argv[3])
    from trainer_support import make_train_batch
    from rlbus.configs.trainer import TrainerConfig
    from rlbus_trainer.engine import build_engine, setup_distributed, teardown_distributed
    from rlbus_trainer.loss import build_loss_fn
    from rlbus_trainer.service import rank_micro_batches

    config = TrainerConfig.model_validate(json.loads(open(sys.argv[1]).read()))
    world = setup_distributed()
    try:
        engine = build_engine(config, world)
        loss_fn = build_loss_fn(config.loss)
        steps = []
        for step in (1, 2, 3):
            batch = make_train_batch(step, num_ranks=2, num_sequences=4)
            mbs = rank_micro_batches(batch, world.rank, world.world_size)
            result = engine.train_step(mbs, loss_fn)
            steps.append({"loss": result.loss, "grad_norm": result.grad_norm, **result.metrics})
        if world.is_main:
            open(sys.argv[2], "w").write(json.dumps(steps))
    finally:
        # A rank that exits with its gloo group alive can abort in the group's destructor
        # ("terminate called without an active exception", 1 run in 5 here).
        teardown_distributed()
    """
)


def run_steps(tmp_path: Path, config: dict, num_ranks: int) -> list[dict]:
    (tmp_path / "steps.py").write_text(SCRIPT)
    (tmp_path / "config.json").write_text(json.dumps(config))
    out = tmp_path / f"steps-{num_ranks}.json"
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={num_ranks}",
        str(tmp_path / "steps.py"),
        str(tmp_path / "config.json"),
        str(out),
        str(TESTS),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.parametrize(
    "loss, lora",
    [
        ({"type": "gspo", "eps_low": 0.5, "eps_high": 0.5, "ref_kl_coef": 0.5}, {"rank": 4}),
        ({"type": "dr_grpo", "max_tokens": 6}, None),
        ({"type": "dapo", "ref_kl_coef": 0.5}, None),
    ],
    ids=["gspo-lora-ref-kl", "dr-grpo", "dapo-sharded-ref-kl"],
)
def test_two_ranks_give_the_steps_of_one_rank(tiny_model, tmp_path, loss, lora):
    config = {
        "model": {"name": str(tiny_model)},
        "optim": {"type": "adamw", "lr": 1e-2, "weight_decay": 0.0},
        "loss": loss,
        "lora": lora,
    }
    one = run_steps(tmp_path, config, 1)
    two = run_steps(tmp_path, config, 2)
    assert len(one) == len(two) == 3
    for a, b in zip(one, two, strict=True):
        assert set(a) == set(b)
        for key in a:
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-7), key
    if "ref_kl_coef" in loss:
        assert one[0]["ref_kl"] == 0 and one[2]["ref_kl"] > 0
