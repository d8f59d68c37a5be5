"""GPU placement (`rlbus.placement.place_gpus`) and the three places that use it: the local
launcher's dry run, the compose GPU override (`rl compose-gpus`) and the sbatch rendering; the
same config gives the same split in all three. Runs on a CPU host through an explicit
`deployment.gpu_ids`."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rlbus.configs import RLConfig, SlurmConfig
from rlbus.configs.base import parse_cli
from rlbus.placement import PlacementError, detected_gpus, place_gpus
from rlbus_launch.composegpus import INFERENCE_FLAGS, override, render
from rlbus_launch.plan import build_rl_launch
from rlbus_launch.slurm import rl_job

ROOT = Path(__file__).resolve().parents[3]
DEBUG_RL = ROOT / "configs" / "debug" / "rl.toml"
BIN = Path(sys.executable).parent


def rl_config(gpus: int, tp: int, infer: int, train: int, *flags: str) -> RLConfig:
    return parse_cli(
        RLConfig,
        ["@", str(DEBUG_RL), "--deployment.gpu-ids", str(list(range(gpus))),
         "--inference.vllm.tensor-parallel-size", str(tp),
         "--deployment.num-infer-gpus", str(infer), "--deployment.num-train-gpus", str(train),
         "--run.name", "r", *flags],
    )  # fmt: skip


@pytest.mark.parametrize(
    ("gpus", "tp", "infer", "train", "replicas", "trainer"),
    [
        (1, 1, 1, 0, [[0]], []),  # an inference node of a multi-node job: no trainer
        (2, 1, 1, 1, [[0]], [1]),
        (2, 2, 2, 0, [[0, 1]], []),
        (8, 1, 4, 4, [[0], [1], [2], [3]], [4, 5, 6, 7]),
        (8, 2, 4, 4, [[0, 1], [2, 3]], [4, 5, 6, 7]),
        (8, 4, 4, 4, [[0, 1, 2, 3]], [4, 5, 6, 7]),
        (8, 2, 6, 2, [[0, 1], [2, 3], [4, 5]], [6, 7]),
    ],
)
def test_place_gpus_gives_each_replica_tp_gpus_and_the_trainer_the_next(
    gpus, tp, infer, train, replicas, trainer
):
    placement = place_gpus(
        list(range(gpus)), num_replicas=infer // tp, tensor_parallel_size=tp, num_train_gpus=train
    )
    assert [list(r) for r in placement.inference] == replicas
    assert list(placement.trainer) == trainer
    used = [g for r in placement.inference for g in r] + list(placement.trainer)
    assert len(used) == len(set(used))


def test_explicit_lists_and_an_unordered_gpu_list_are_kept():
    placement = place_gpus(
        [7, 6, 5, 4], num_replicas=1, tensor_parallel_size=2, num_train_gpus=2,
        train_gpu_ids=[7, 4],
    )  # fmt: skip
    assert placement.inference == ((6, 5),) and placement.trainer == (7, 4)


@pytest.mark.parametrize(
    ("kwargs", "field", "words"),
    [
        ({"gpu_ids": [0, 1, 1]}, "deployment.gpu_ids", "lists GPU 1 twice"),
        ({"gpu_ids": [0, 1], "num_train_gpus": 2}, "deployment.gpu_ids", "needs 3 GPUs"),
        ({"infer_gpu_ids": [0], "train_gpu_ids": [0]}, "deployment.train_gpu_ids",
         "GPU 0 is also in deployment.infer_gpu_ids"),
        ({"infer_gpu_ids": [0, 1]}, "deployment.infer_gpu_ids", "names 2 GPUs"),
        ({"train_gpu_ids": [9]}, "deployment.train_gpu_ids", "GPU 9 is not among"),
    ],
)  # fmt: skip
def test_a_split_that_cannot_work_names_the_field(kwargs, field, words):
    args = {"gpu_ids": [0, 1, 2, 3], "num_replicas": 1, "tensor_parallel_size": 1}
    with pytest.raises(PlacementError, match=re.escape(words)) as error:
        place_gpus(**({"num_train_gpus": 1} | args | kwargs))
    assert error.value.field == field


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--inference.vllm.tensor-parallel-size", "2", "--deployment.num-infer-gpus", "3"],
         "--deployment.num-infer-gpus: must be a multiple of inference.vllm.tensor_parallel_size"),
        (["--deployment.num-infer-gpus", "4", "--deployment.num-infer-replicas", "2"],
         "--deployment.num-infer-replicas: must be deployment.num_infer_gpus"),
        (["--deployment.gpu-ids", "[0,1]", "--deployment.num-infer-gpus", "2"],
         "--deployment.gpu-ids: the run needs 3 GPUs"),
        (["--deployment.infer-gpu-ids", "[0]", "--deployment.train-gpu-ids", "[0]"],
         "--deployment.train-gpu-ids: GPU 0 is also in deployment.infer_gpu_ids"),
    ],
)  # fmt: skip
def test_the_rl_command_refuses_a_bad_split_in_one_message(tmp_path, flags, words):
    result = subprocess.run(
        [BIN / "rl", "@", DEBUG_RL, "--dry-run", "--output-dir", tmp_path, *flags],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2
    assert words in " ".join(re.sub(r"[│╭╮╰╯─]", " ", result.stderr).split())
    assert "Traceback" not in result.stderr


def test_prime_rl_inference_gpus_set_the_replicas():
    config = rl_config(8, 2, 6, 2)
    assert config.deployment.num_infer_replicas == 3


def test_the_dry_run_scripts_show_each_process_its_devices(tmp_path):
    result = subprocess.run(
        [BIN / "rl", "@", DEBUG_RL, "--dry-run", "--output-dir", tmp_path, "--run.name", "r",
         "--deployment.gpu-ids", "[0,1,2,3,4,5,6,7]", "--deployment.num-infer-gpus", "4",
         "--inference.vllm.tensor-parallel-size", "2", "--deployment.num-train-gpus", "4"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    scripts = tmp_path / "r" / "scripts"
    expected = {"inference-0": "0,1", "inference-1": "2,3", "trainer": "4,5,6,7"}
    for name, devices in expected.items():
        text = (scripts / f"{name}.sh").read_text()
        assert f"export CUDA_VISIBLE_DEVICES={devices}\n" in text, name
        assert "taskset" not in text  # GPUs are placed, cores are not pinned
    assert "--nproc-per-node 4" in (scripts / "trainer.sh").read_text()
    assert "CUDA_VISIBLE_DEVICES" not in (scripts / "orchestrator.sh").read_text()


def launcher_split(config: RLConfig, tmp_path: Path) -> list[str]:
    launch = build_rl_launch(config.with_run_name("r"), tmp_path / "local")
    env = {p.name: p.env.get("CUDA_VISIBLE_DEVICES") for p in launch.processes}
    return [env[name] for name in sorted(env) if env[name] is not None]


def compose_split(config: RLConfig) -> list[str]:
    services = override(config_placement(config), [])["services"]
    devices = {
        name: service["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"]
        for name, service in services.items()
        if "deploy" in service
    }
    named = {("inference-0" if n == "inference" else n): ",".join(d) for n, d in devices.items()}
    return [named[name] for name in sorted(named)]


def config_placement(config: RLConfig):
    from rlbus.configs.rl import gpu_placement

    return gpu_placement(config, config.deployment.gpu_ids or [])


def slurm_split(config: RLConfig, tmp_path: Path) -> list[str]:
    slurm_config = config.model_copy(deep=True)
    slurm_config.slurm = SlurmConfig(gpus_per_node=8)
    job, _ = rl_job(slurm_config.with_run_name("r"), tmp_path / "slurm")
    found = {}
    for step in job.steps:
        match = re.search(r"CUDA_VISIBLE_DEVICES=([\d,]+)", step.command)
        if match:
            found[step.name] = match[1]
    return [found[name] for name in sorted(found)]


@pytest.mark.parametrize(("tp", "infer", "train"), [(1, 1, 1), (2, 4, 4), (4, 4, 2)])
def test_launcher_compose_and_slurm_give_the_same_split(tmp_path, tp, infer, train):
    config = rl_config(8, tp, infer, train)
    local = launcher_split(config, tmp_path)
    assert local == compose_split(config) == slurm_split(config, tmp_path)
    assert len(local) == infer // tp + 1


def test_the_committed_gpu_override_is_the_generators_output_and_valid_yaml():
    committed = (ROOT / "deploy" / "docker-compose.gpu.yml").read_text()
    source = committed.splitlines()[0].split("`")[1].split()[2:]  # the args after the command
    config = parse_cli(RLConfig, source)
    assert render(config, source) == committed
    services = yaml.safe_load(committed)["services"]
    assert services["trainer"]["entrypoint"][-3:] == ["1", "-m", "rlbus_trainer.entrypoint"]
    assert services["resolve"]["environment"]["RLBUS_ARGS"].endswith("${RLBUS_ARGS:-}")


def test_the_override_repeats_the_base_files_inference_flags_for_each_replica():
    base = yaml.safe_load((ROOT / "deploy" / "docker-compose.yml").read_text())
    base_command = base["services"]["inference"]["command"]
    assert base_command[2:] == INFERENCE_FLAGS
    services = override(config_placement(rl_config(4, 1, 2, 2)), [])["services"]
    assert services["inference-1"]["command"][1].endswith("/configs/inference-1.toml")
    assert services["inference-1"]["extends"] == {
        "file": "docker-compose.yml",
        "service": "inference",
    }


def test_detected_gpus_read_cuda_visible_devices_then_the_device_nodes(tmp_path):
    for name in ("nvidia0", "nvidia3", "nvidiactl", "nvidia-uvm"):
        (tmp_path / name).touch()
    assert detected_gpus({}, tmp_path) == [0, 3]
    assert detected_gpus({"CUDA_VISIBLE_DEVICES": "2,5"}, tmp_path) == [2, 5]
    assert detected_gpus({"CUDA_VISIBLE_DEVICES": ""}, tmp_path) == []
    assert detected_gpus({"CUDA_VISIBLE_DEVICES": "-1"}, tmp_path) == []
    with pytest.raises(PlacementError, match="deployment.gpu_ids"):
        detected_gpus({"CUDA_VISIBLE_DEVICES": "GPU-8d1f"}, tmp_path)


def test_compose_gpus_on_a_host_without_gpus_is_one_line_and_exit_2(tmp_path):
    result = subprocess.run(
        [BIN / "rl", "compose-gpus", "@", DEBUG_RL, "--out", tmp_path / "gpu.yml"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
        env={"PATH": str(BIN), "CUDA_VISIBLE_DEVICES": ""},
    )  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "the node has 0 []" in result.stderr
    assert not (tmp_path / "gpu.yml").exists()
