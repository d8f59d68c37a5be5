"""How `rl` starts the trainer: one rank without torchrun's agent, more ranks under torchrun."""

import sys

from rlbus.configs import RLConfig
from rlbus_launch.plan import build_rl_launch


def trainer_argv(tmp_path, *ranks: str) -> list[str]:
    deployment = {"cpu_binding": "off"}
    if ranks:
        deployment["num_train_gpus"] = int(ranks[0])
    launch = build_rl_launch(RLConfig(deployment=deployment).with_run_name("r"), tmp_path)
    (trainer,) = [p for p in launch.processes if p.name == "trainer"]
    return trainer.argv


def test_one_rank_is_the_trainer_module_itself(tmp_path):
    argv = trainer_argv(tmp_path)
    config = str((tmp_path / "configs" / "trainer.toml").absolute())
    assert argv == [sys.executable, "-m", "rlbus_trainer.entrypoint", "@", config]


def test_two_ranks_go_through_torchrun(tmp_path):
    argv = trainer_argv(tmp_path, "2")
    assert argv[1:3] == ["-m", "torch.distributed.run"]
    assert argv[argv.index("--nproc-per-node") + 1] == "2"
    assert argv[-4:-2] == ["-m", "rlbus_trainer.entrypoint"]
