"""`rl --dry-run` / `sft --dry-run`: resolved configs and launch scripts that repeat the launch."""

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import time
from pathlib import Path

import tomli
from cli_helpers import REPO, error_text, run_command

DEBUG_RL = str(REPO / "configs/debug/rl.toml")
DEBUG_SFT = str(REPO / "configs/debug/sft.toml")


def exec_argv(script: Path) -> list[str]:
    """The argv of a process script's `exec` line."""
    line = next(line for line in script.read_text().splitlines() if line.startswith("exec "))
    return shlex.split(line)[1:]


def service_argv(argv: list[str]) -> list[str]:
    """`[taskset -c N] python -m torch.distributed.run ... -m module @ cfg` -> `python -m module @ cfg`
    (one rank, unpinned)."""
    if Path(argv[0]).name == "taskset":
        argv = argv[3:]
    if "torch.distributed.run" not in argv:
        return argv
    module_at = len(argv) - 1 - argv[::-1].index("-m")
    return [argv[0], *argv[module_at:]]


def load_toml(path: Path) -> dict:
    return tomli.loads(path.read_text())


def wait_for_port(port: int, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise TimeoutError(f"nothing listens on {port}")


def test_cpu_binding_gives_inference_and_trainer_disjoint_cores(tmp_path):
    """2+ usable cores and no GPU: vLLM's compute threads and the trainer get disjoint halves;
    `threads` pins only vLLM's compute threads, not its processes; `off` pins nothing."""
    if len(os.sched_getaffinity(0)) < 2 or Path("/dev/nvidiactl").exists():
        import pytest

        pytest.skip("needs a GPU-less host with at least 2 usable cores")
    result = run_command("rl", "@", DEBUG_RL, "--dry-run", "--run.name", "b1", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    scripts = tmp_path / "outputs" / "b1" / "scripts"
    bind = re.search(
        r"export VLLM_CPU_OMP_THREADS_BIND=([\d,]+)", (scripts / "inference.sh").read_text()
    )
    argv = exec_argv(scripts / "trainer.sh")
    assert bind and Path(argv[0]).name == "taskset" and argv[1] == "-c"
    inference_cores, trainer_cores = set(bind.group(1).split(",")), set(argv[2].split(","))
    assert inference_cores and trainer_cores and not inference_cores & trainer_cores
    assert inference_cores | trainer_cores == {str(c) for c in os.sched_getaffinity(0)}
    assert "export OMP_NUM_THREADS=" in (scripts / "trainer.sh").read_text()

    argv = exec_argv(scripts / "inference.sh")  # auto: the whole inference process tree, too
    assert Path(argv[0]).name == "taskset" and set(argv[2].split(",")) == inference_cores

    result = run_command(
        "rl",
        "@",
        DEBUG_RL,
        "--dry-run",
        "--run.name",
        "b3",
        "--deployment.cpu-binding",
        "threads",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    scripts = tmp_path / "outputs" / "b3" / "scripts"
    assert "VLLM_CPU_OMP_THREADS_BIND" in (scripts / "inference.sh").read_text()
    assert Path(exec_argv(scripts / "inference.sh")[0]).name != "taskset"

    result = run_command(
        "rl",
        "@",
        DEBUG_RL,
        "--dry-run",
        "--run.name",
        "b2",
        "--deployment.cpu-binding",
        "off",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    scripts = tmp_path / "outputs" / "b2" / "scripts"
    assert "VLLM_CPU_OMP_THREADS_BIND" not in (scripts / "inference.sh").read_text()
    assert Path(exec_argv(scripts / "trainer.sh")[0]).name != "taskset"


def test_rl_dry_run_writes_every_resolved_config_and_one_script_per_process(tmp_path):
    result = run_command("rl", "@", DEBUG_RL, "--dry-run", "--run.name", "t1", cwd=tmp_path)

    assert result.returncode == 0, result.stderr
    run_dir = tmp_path / "outputs" / "t1"
    assert "Run directory: outputs/t1" in result.stdout and "launch.sh" in result.stdout
    configs = {p.name for p in (run_dir / "configs").iterdir()}
    assert configs == {
        "rl.toml",
        "inference.toml",
        "orchestrator.toml",
        "trainer.toml",
        "nats.conf",
        "bus.json",  # where outside readers find the bus (docs/bus.md, "Reading a run")
    }
    scripts = sorted((run_dir / "scripts").iterdir())
    assert [p.name for p in scripts] == [
        "inference.sh",
        "launch.sh",
        "monitor.sh",
        "nats.sh",
        "orchestrator.sh",
        "trainer.sh",
    ]
    assert all(os.access(p, os.X_OK) for p in scripts)
    launch_all = (run_dir / "scripts" / "launch.sh").read_text()
    order = [
        launch_all.index(f'"$here/{name}.sh"')
        for name in ("nats", "inference", "orchestrator", "trainer")
    ]
    assert order == sorted(order)
    assert not (run_dir / "nats").exists()  # nothing was started


def test_rl_dry_run_service_configs_match_the_resolved_rl_config(tmp_path):
    run_command(
        "rl",
        "@",
        DEBUG_RL,
        "--dry-run",
        "--run.name",
        "t2",
        "--trainer.max-steps",
        "4",
        cwd=tmp_path,
    )
    configs = tmp_path / "outputs" / "t2" / "configs"
    rl, trainer = load_toml(configs / "rl.toml"), load_toml(configs / "trainer.toml")
    nats_port = json.loads((configs / "nats.conf").read_text())["port"]

    debug = load_toml(Path(DEBUG_RL))
    assert trainer["max_steps"] == 4 and rl["max_steps"] == debug["max_steps"] != 4
    assert (
        trainer["model"]["name"] == rl["model"]["name"]
        and trainer["optim"]["lr"] == rl["trainer"]["optim"]["lr"]
    )
    assert (
        load_toml(configs / "orchestrator.toml")["batch_size"]
        == rl["orchestrator"]["batch_size"]
        == debug["orchestrator"]["batch_size"]
    )
    assert trainer["bus"]["url"] == f"nats://127.0.0.1:{nats_port}"
    assert (
        "url" not in rl["bus"]
    )  # rl.toml keeps "embedded server", so `rl @ rl.toml --resume` starts one
    assert trainer["run"]["name"] == "t2" and trainer["bus"]["run_id"] == "t2"
    assert load_toml(configs / "inference.toml")["run_dir"] == "outputs/t2"
    # clean/dry_run are the launcher's: rl.toml has them off, the services do not have them.
    assert "clean" not in trainer and "dry_run" not in trainer
    assert rl["clean"] is False and rl["dry_run"] is False


def test_dry_run_scripts_reproduce_the_launch(tmp_path):
    run_command("rl", "@", DEBUG_RL, "--dry-run", "--run.name", "t3", cwd=tmp_path)
    run_dir = tmp_path / "outputs" / "t3"

    # Every service script runs its service on exactly the config file that was written.
    for name in ("inference", "orchestrator", "trainer"):
        argv = exec_argv(run_dir / "scripts" / f"{name}.sh")
        assert argv[-2:] == ["@", str((run_dir / "configs" / f"{name}.toml").absolute())]
        printed = subprocess.run(
            [*service_argv(argv), "--print-config"], cwd=tmp_path, capture_output=True, text=True
        )
        assert printed.returncode == 0, printed.stderr
        assert tomli.loads(printed.stdout) == load_toml(run_dir / "configs" / f"{name}.toml")
    # One rank: the trainer module itself, no torchrun agent (docs/launcher.md)
    assert "torch.distributed.run" not in exec_argv(run_dir / "scripts" / "trainer.sh")

    # The NATS script really starts the embedded server on the port written into the configs.
    port = json.loads((run_dir / "configs" / "nats.conf").read_text())["port"]
    server = subprocess.Popen(
        ["bash", str(run_dir / "scripts" / "nats.sh")], cwd="/", start_new_session=True
    )
    try:
        wait_for_port(port)
        assert (run_dir / "nats" / "jetstream").is_dir()  # the store lives in the run directory
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(10)


def test_rl_generates_a_fresh_readable_run_name_per_launch(tmp_path):
    first = run_command("rl", "--dry-run", "--model.name", "Org/Tiny-Model", cwd=tmp_path)
    second = run_command("rl", "--dry-run", "--model.name", "Org/Tiny-Model", cwd=tmp_path)

    names = sorted(p.name for p in (tmp_path / "outputs").iterdir())
    assert first.returncode == second.returncode == 0
    assert len(names) == 2
    assert all(re.fullmatch(r"reverse-text--tiny-model--[0-9a-f]{6}", n) for n in names)
    for name in names:  # the generated name is kept for relaunching from configs/rl.toml
        assert load_toml(tmp_path / "outputs" / name / "configs" / "rl.toml")["run"]["name"] == name


def test_rl_refuses_a_used_run_directory_unless_resume_or_clean(tmp_path):
    args = ("--dry-run", "--run.name", "again")
    assert run_command("rl", *args, cwd=tmp_path).returncode == 0
    marker = tmp_path / "outputs" / "again" / "metrics.jsonl"
    marker.write_text("{}\n")

    refused = run_command("rl", *args, cwd=tmp_path)
    resumed = run_command("rl", *args, "--resume", cwd=tmp_path)
    assert marker.exists()  # resume keeps the artifacts
    cleaned = run_command("rl", *args, "--clean", cwd=tmp_path)

    assert refused.returncode == 2
    assert "--resume to continue that run, or --clean to wipe it" in error_text(refused)
    assert resumed.returncode == 0 and cleaned.returncode == 0
    assert not marker.exists() and (tmp_path / "outputs" / "again" / "configs" / "rl.toml").exists()


def test_sft_dry_run_names_the_run_after_dataset_and_model_and_writes_a_torchrun_script(tmp_path):
    result = run_command("sft", "@", DEBUG_SFT, "--dry-run", "--run.name", "None", cwd=tmp_path)

    assert result.returncode == 0, result.stderr
    (run_dir,) = (tmp_path / "outputs").iterdir()
    assert re.fullmatch(r"reverse-text--tiny-qwen3--[0-9a-f]{6}", run_dir.name)
    argv = exec_argv(run_dir / "scripts" / "sft.sh")
    assert argv[1:7] == [
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "1",
        "-m",
    ]
    assert argv[7:] == [
        "rlbus_trainer.sft_entrypoint",
        "@",
        str((run_dir / "configs" / "sft.toml").absolute()),
    ]
    printed = subprocess.run(
        [*service_argv(argv), "--print-config"], cwd=tmp_path, capture_output=True, text=True
    )
    written = load_toml(run_dir / "configs" / "sft.toml")
    assert tomli.loads(printed.stdout) == written
    assert written["run"]["name"] == run_dir.name and written["max_steps"] == 20


def test_each_inference_replica_gets_its_own_config_ports_and_script(tmp_path):
    result = run_command(
        "rl", "--dry-run", "--run.name", "two", "--deployment.num-infer-replicas", "2",
        "--bus.url", "nats://bus:4222", "--inference.server.port", "8000", "--inference.backend-port", "8100",
        cwd=tmp_path,
    )  # fmt: skip

    run_dir = tmp_path / "outputs" / "two"
    assert result.returncode == 0, result.stderr
    replicas = [load_toml(run_dir / "configs" / f"inference-{i}.toml") for i in (0, 1)]
    assert [(r["server"]["port"], r["backend_port"], r["replica_id"]) for r in replicas] == [
        (8000, 8100, "0"),
        (8001, 8101, "1"),
    ]
    assert (run_dir / "scripts" / "inference-1.sh").exists()
    assert not (run_dir / "scripts" / "nats.sh").exists()  # external bus: no embedded server
    assert all(r["bus"]["url"] == "nats://bus:4222" for r in replicas)


def test_relaunching_from_the_written_rl_config_repeats_the_run(tmp_path):
    run_command("rl", "@", DEBUG_RL, "--dry-run", "--run.name", "again", cwd=tmp_path)
    configs = tmp_path / "outputs" / "again" / "configs"
    first = {
        name: load_toml(configs / f"{name}.toml")
        for name in ("trainer", "orchestrator", "inference")
    }

    relaunch = run_command(
        "rl",
        "@",
        str(configs / "rl.toml"),
        "--dry-run",
        "--resume",
        "--max-steps",
        "9",
        cwd=tmp_path,
    )

    assert relaunch.returncode == 0, relaunch.stderr
    second = {name: load_toml(configs / f"{name}.toml") for name in first}
    for name in first:
        for config in (first[name], second[name]):
            config["bus"].pop("url")  # a fresh free port for the embedded server
            if name == "inference":  # and for inference ports the user did not set
                config["server"].pop("port")
                config.pop("backend_port")
            config["metrics"].pop("port")  # and for each process's /metrics (docs/metrics.md)
            config.pop("max_steps", None)
            config.pop("resume", None)  # the relaunch resumes
        assert first[name] == second[name], name
    assert (
        load_toml(configs / "trainer.toml")["max_steps"] == 9
    )  # a new top-level value still pushes down


def test_inference_ports_left_unset_are_free_ports_not_the_defaults(tmp_path):
    result = run_command(
        "rl",
        "--dry-run",
        "--run.name",
        "ports",
        "--deployment.num-infer-replicas",
        "2",
        cwd=tmp_path,
    )

    assert result.returncode == 0, result.stderr
    configs = tmp_path / "outputs" / "ports" / "configs"
    replicas = [load_toml(configs / f"inference-{i}.toml") for i in (0, 1)]
    ports = [p for r in replicas for p in (r["server"]["port"], r["backend_port"])]
    assert len(set(ports)) == 4 and not {8000, 8001, 8100, 8101} & set(ports)


def test_rollout_worker_processes_run_the_orchestrator_config_as_workers(tmp_path):
    result = run_command(
        "rl", "@", DEBUG_RL, "--dry-run", "--run.name", "w2",
        "--deployment.num-rollout-workers", "2", cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    scripts = tmp_path / "outputs" / "w2" / "scripts"
    orchestrator = exec_argv(scripts / "orchestrator.sh")
    assert "--role" not in orchestrator
    ports = set()
    for i in range(2):  # each with a /metrics port of its own (docs/metrics.md)
        worker = exec_argv(scripts / f"worker-{i}.sh")
        assert worker[: len(orchestrator)] == orchestrator and worker[-2:] == ["--role", "worker"]
        assert worker[len(orchestrator) : -2][0] == "--metrics.port"
        ports.add(worker[len(orchestrator) : -2][1])
    assert len(ports) == 2
    assert not (scripts / "worker-2.sh").exists()
    launch = (scripts / "launch.sh").read_text()
    assert (
        launch.index("orchestrator.sh") < launch.index("worker-0.sh") < launch.index("trainer.sh")
    )


def test_rl_dead_letters_is_the_listing_command_and_names_a_bad_run_dir(tmp_path):
    result = run_command("rl", "dead-letters", str(tmp_path / "no-such-run"), cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "no-such-run" in lines[0] and "Traceback" not in result.stderr
    assert "rl dead-letters" in run_command("rl", "dead-letters", "--help", cwd=tmp_path).stdout
