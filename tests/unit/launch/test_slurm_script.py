"""`rl/sft/inference --slurm --dry-run`: the rendered sbatch script and the resolved configs."""

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from rlbus.configs import RLConfig, SlurmConfig
from rlbus.configs.base import parse_cli
from rlbus_launch.slurm import SlurmSetupError, one_node_gpus, rl_job

ROOT = Path(__file__).resolve().parents[3]
DEBUG_RL = ROOT / "configs" / "debug" / "rl.toml"
BIN = Path(sys.executable).parent


def dry_run(tmp_path: Path, *flags: str) -> tuple[str, Path]:
    result = subprocess.run(
        [BIN / "rl", "@", DEBUG_RL, "--slurm", "--dry-run", "--output-dir", tmp_path,
         "--run.name", "r", *flags],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    run_dir = tmp_path / "r"
    return (run_dir / "slurm" / "rl.sbatch").read_text(), run_dir


def test_single_node_script_is_valid_bash_with_absolute_paths_and_a_drain(tmp_path):
    script, run_dir = dry_run(tmp_path, "--slurm.time", "01:00:00", "--slurm.requeue")
    assert subprocess.run(["bash", "-n", "-c", script]).returncode == 0
    assert "$0" not in script and "dirname" not in script
    assert f"--store {run_dir.absolute()}/nats" in script
    assert "#SBATCH --signal=B:TERM@" in script and "#SBATCH --requeue" in script
    assert "#SBATCH --time=01:00:00" in script
    assert 'trap \'say "SIGTERM: draining"; stop_all' in script
    assert "--exit-when-finished" in script.split("start 1 monitor", 1)[1].split("\n")[0]
    assert "srun " not in script.split("mapfile", 1)[1]
    assert not (run_dir / "nats").exists()  # the sidecar creates its store, not the submit


def test_resolved_configs_exit_when_finished_and_pick_free_ports(tmp_path):
    _, run_dir = dry_run(tmp_path)
    inference = tomllib.loads((run_dir / "configs" / "inference.toml").read_text())
    orchestrator = tomllib.loads((run_dir / "configs" / "orchestrator.toml").read_text())
    assert inference["exit_when_finished"] and orchestrator["exit_when_finished"]
    assert inference["server"]["port"] == 0 and inference["backend_port"] == 0
    assert inference.get("slurm", "None") == "None"  # a service never resubmits
    assert "slurm" in tomllib.loads((run_dir / "configs" / "rl.toml").read_text())


def test_multi_node_trainer_srun_has_explicit_task_counts_and_c10d(tmp_path):
    script, _ = dry_run(tmp_path, "--slurm.nodes", "3", "--slurm.inference-nodes", "1")
    trainer = next(line for line in script.splitlines() if line.startswith("start 0 trainer"))
    assert "srun --nodes=2 --ntasks=2 --ntasks-per-node=1" in trainer and "--overlap" in trainer
    assert '--rdzv-backend c10d --rdzv-endpoint "$RDZV:29500"' in trainer
    assert "--nnodes 2" in trainer
    assert 'TRAIN_NODES=("${NODES[@]:1}")' in script


def test_one_node_gpus_are_disjoint():
    config = parse_cli(
        RLConfig,
        ["@", str(DEBUG_RL), "--slurm.gpus-per-node", "8", "--slurm.inference-gpus", "4",
         "--inference.vllm.tensor-parallel-size", "2", "--deployment.num-train-gpus", "4"],
    )  # fmt: skip
    assert config.slurm is not None and config.deployment.num_infer_replicas == 2
    inference, trainer = one_node_gpus(config, config.slurm)
    assert inference == [[0, 1], [2, 3]] and trainer == [4, 5, 6, 7]
    cpu = config.model_copy(update={"slurm": SlurmConfig()})
    assert one_node_gpus(cpu, SlurmConfig()) == ([None, None], None)


def test_gpu_split_that_does_not_fit_names_the_fields(tmp_path):
    config = parse_cli(
        RLConfig,
        ["@", str(DEBUG_RL), "--slurm.gpus-per-node", "2", "--slurm.inference-gpus", "2",
         "--run.name", "r", "--output-dir", str(tmp_path)],
    )  # fmt: skip
    with pytest.raises(SlurmSetupError, match="needs 3 GPUs.*num_train_gpus.*gpus_per_node = 2"):
        rl_job(config.with_run_name("r"), tmp_path / "r")


def test_sbatch_missing_is_one_line(tmp_path):
    result = subprocess.run(
        [BIN / "rl", "@", DEBUG_RL, "--slurm", "--output-dir", tmp_path, "--run.name", "r"],
        cwd=ROOT, capture_output=True, text=True, timeout=60, env={"PATH": "/nonexistent"},
    )  # fmt: skip
    assert result.returncode == 1
    assert result.stderr.strip().count("\n") == 0 and "sbatch is not on PATH" in result.stderr


def test_inference_slurm_renders_one_replica_per_node_from_its_resolved_config(tmp_path):
    run_dir = tmp_path / "run"
    result = subprocess.run(
        [BIN / "inference", "--slurm", "--run-dir", run_dir, "--vllm.model", "m",
         "--bus.url", "nats://head:4222", "--no-slurm.submit", "--slurm.nodes", "2"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    script = (run_dir / "slurm" / "inference.sbatch").read_text()
    assert subprocess.run(["bash", "-n", "-c", script]).returncode == 0
    replica = next(line for line in script.splitlines() if line.startswith("start 1 inference"))
    assert "srun --nodes=2 --ntasks=2 --ntasks-per-node=1" in replica
    resolved = tomllib.loads((run_dir / "configs" / "inference-slurm.toml").read_text())
    assert resolved["bus"]["url"] == "nats://head:4222" and resolved["exit_when_finished"]
    assert resolved["server"]["port"] == 0 and resolved.get("slurm", "None") == "None"


def test_inference_slurm_without_run_dir_is_one_line(tmp_path):
    result = subprocess.run(
        [BIN / "inference", "--slurm", "--vllm.model", "m"],
        cwd=tmp_path, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and "--run-dir" in result.stderr
