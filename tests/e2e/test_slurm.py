"""`rl --slurm` on a real SLURM: munged, slurmctld and two slurmd (two node names on this host)
started here with their own config, state, spool and ports under a temp dir, stopped by PID.

One job runs the debug config to the end (COMPLETED, every step's metrics row, reward up); a
second one is stopped with `scancel --batch --signal=TERM` and must drain (the script's trap
SIGTERMs the services, which log their drain, and the job ends without a SIGKILL).
"""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from e2e_support import BIN, DEBUG_RL, REPO, run_rows, steps_with, wait_for

from rlbus.netutil import free_ports

pytestmark = pytest.mark.slow

DAEMONS = ("munged", "slurmctld", "slurmd")
JOB_TIMEOUT_S = 420
NODES = ("n1", "n2")


def ensure_slurm_installed() -> None:
    """Debian's slurm-wlm and munge, installed with apt when a clean machine lacks them."""
    if all(shutil.which(tool) for tool in ("sbatch", "slurmctld", "slurmd", "munged")):
        return
    if os.geteuid() != 0:
        pytest.skip("SLURM is not installed and installing it needs root (apt-get)")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-q"], check=True, env=env)
    subprocess.run(["apt-get", "install", "-y", "-q", "slurm-wlm", "munge"], check=True, env=env)


def slurm_conf(root: Path, ctld_port: int, node_ports: list[int], user: str) -> str:
    """One controller and two node names on this host (NodeAddr 127.0.0.1, own slurmd port),
    no cgroups (proctrack/linuxproc, task/none), no accounting, jobs kept 10 min for scontrol."""
    host = socket.gethostname().split(".")[0]
    cpus = os.cpu_count() or 1
    nodes = "\n".join(
        f"NodeName={name} NodeHostname={host} NodeAddr=127.0.0.1 Port={port} CPUs={cpus} "
        "RealMemory=1000 State=UNKNOWN"
        for name, port in zip(NODES, node_ports, strict=True)
    )
    return f"""\
ClusterName=rlbus-test
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmUser={user}
SlurmdUser={user}
AuthType=auth/munge
CryptoType=crypto/munge
AuthInfo=socket={root}/munge/munge.socket
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd-%n.log
PlugStackConfig={root}/plugstack.conf
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
ReturnToService=2
KillWait=60
MinJobAge=900
{nodes}
PartitionName=debug Nodes={",".join(NODES)} Default=YES MaxTime=INFINITE State=UP
"""


@dataclass
class LocalSlurm:
    """The daemons this test started (PIDs) and the environment the client commands need."""

    root: Path
    env: dict[str, str]
    procs: list[subprocess.Popen] = field(default_factory=list)

    def start(self, name: str, argv: list[str]) -> None:
        log = open(self.root / "log" / f"{name}.out", "ab")
        self.procs.append(
            subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=self.env)
        )

    def run(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run(argv, env=self.env, capture_output=True, text=True, check=check)

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job -o` as key -> value (JobState, ExitCode, ...)."""
        out = self.run("scontrol", "show", "job", "-o", job_id).stdout
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def wait_job(self, job_id: str, timeout_s: float = JOB_TIMEOUT_S) -> dict[str, str]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            job = self.job(job_id)
            if job.get("JobState") not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING"):
                return job
            time.sleep(2)
        raise AssertionError(f"job {job_id} still {self.job(job_id).get('JobState')}")

    def stop(self) -> None:
        """SIGTERM exactly the daemons started here, last started first; SIGKILL stragglers."""
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in reversed(self.procs):
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def daemon_log(self) -> str:
        return "\n".join(
            f"--- {path.name}\n{path.read_text(errors='replace')[-3000:]}"
            for path in sorted((self.root / "log").glob("*"))
        )


def start_local_slurm(root: Path) -> LocalSlurm:
    """munged with its own key and socket, slurmctld, one slurmd per node name; waits until both
    nodes are idle."""
    for sub in ("munge", "state", "log", "spool/n1", "spool/n2"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    (root / "munge").chmod(0o700)
    key = root / "munge" / "munge.key"
    key.write_bytes(os.urandom(128))
    key.chmod(0o400)
    (root / "plugstack.conf").write_text("")
    user = os.environ.get("USER") or "root"
    ctld_port, *node_ports = free_ports(3)
    conf = root / "slurm.conf"
    conf.write_text(slurm_conf(root, ctld_port, node_ports, user))
    env = {**os.environ, "SLURM_CONF": str(conf)}
    slurm = LocalSlurm(root, env)
    socket_path = root / "munge" / "munge.socket"
    slurm.start("munged", [
        "munged", "--foreground", "--force", f"--socket={socket_path}", f"--key-file={key}",
        f"--pid-file={root}/munge/munged.pid", f"--log-file={root}/log/munged.log",
        f"--seed-file={root}/munge/munged.seed",
    ])  # fmt: skip
    wait_for(socket_path.exists, 15, "munged socket")
    slurm.start("slurmctld", ["slurmctld", "-D", "-i", "-f", str(conf)])
    for name in NODES:
        slurm.start(f"slurmd-{name}", ["slurmd", "-D", "-N", name, "-f", str(conf)])

    def idle() -> bool:
        out = slurm.run("sinfo", "-h", "-N", "-o", "%N %t", check=False).stdout
        return sorted(line.split()[1] for line in out.splitlines() if line.strip()) == ["idle"] * 2

    try:
        wait_for(idle, 60, "both SLURM nodes idle")
    except Exception:
        slurm.stop()
        raise AssertionError(slurm.daemon_log()) from None
    return slurm


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    ensure_slurm_installed()
    cluster = start_local_slurm(tmp_path_factory.mktemp("slurm"))
    try:
        yield cluster
    finally:
        cluster.stop()


def submit(slurm: LocalSlurm, output_dir: Path, name: str, *flags: str) -> tuple[str, Path]:
    """`rl @ configs/debug/rl.toml --slurm ...`; returns (job id, run dir)."""
    nats_port, http_port = free_ports(2)
    result = subprocess.run(
        [BIN / "rl", "@", DEBUG_RL, "--slurm", "--output-dir", output_dir, "--run.name", name,
         "--slurm.nats-port", str(nats_port), "--slurm.nats-http-port", str(http_port),
         "--no-slurm.exclusive", "--slurm.grace-s", "40", *flags],
        cwd=REPO, env=slurm.env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    job_id = re.search(r"Submitted SLURM job (\d+)", result.stdout).group(1)
    return job_id, output_dir / name


def service_events(run_dir: Path, service: str, event: str) -> list[dict]:
    """The `event` lines of a service's own log (JSON lines in logs/<service>.log)."""
    found = []
    for line in (run_dir / "logs" / f"{service}.log").read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and record.get("event") == event:
            found.append(record)
    return found


def job_output(run_dir: Path, job_id: str) -> str:
    path = run_dir / "slurm" / f"rl-{job_id}.out"
    return path.read_text() if path.exists() else "(no job output)"


def log_tails(run_dir: Path, lines: int = 12) -> str:
    """The last lines of every service log: what a failed assertion shows besides the job output."""
    parts = []
    for path in sorted((run_dir / "logs").glob("*.log")):
        tail = path.read_text(errors="replace").splitlines()[-lines:]
        parts.append(f"--- {path.name} (last {len(tail)} lines)\n" + "\n".join(tail))
    return "\n".join(parts)


def test_rl_slurm_job_completes_the_run_with_rising_reward(slurm, tmp_path, starting_model):
    job_id, run_dir = submit(slurm, tmp_path, "slurm-e2e", "--model.name", str(starting_model.path))
    job = slurm.wait_job(job_id)
    output = job_output(run_dir, job_id)
    assert job["JobState"] == "COMPLETED" and job["ExitCode"] == "0:0", output
    assert steps_with(run_dir, "loss") == list(range(1, 11)), output
    rows = run_rows(run_dir)
    rewards = [rows[step]["reward/mean"] for step in sorted(rows)]
    if starting_model.trained:
        assert sum(rewards[-4:]) / 4 > sum(rewards[:4]) / 4 + 0.05, rewards
    assert "started nats" in output and "trainer exited with code 0" in output
    assert "SIGKILL" not in output, output
    assert_bus_secured(run_dir)


def test_a_two_node_rl_job_runs_inference_and_trainer_on_different_nodes(
    slurm, tmp_path, starting_model
):
    """`--slurm.nodes 2` on the two node names of this host: NATS, inference, orchestrator and
    monitor on n1, the trainer as a one-node multi-node torchrun on n2 (each its own srun step),
    every service reaching the sidecar at n1's address."""
    (rdzv_port,) = free_ports(1)
    job_id, run_dir = submit(
        slurm, tmp_path, "slurm-2n", "--model.name", str(starting_model.path),
        "--slurm.nodes", "2", "--slurm.rdzv-port", str(rdzv_port), "--max-steps", "4",
    )  # fmt: skip
    step_nodes = set()  # the node list of every job step seen while the job runs
    while slurm.job(job_id).get("JobState") in ("PENDING", "CONFIGURING", "RUNNING"):
        listed = slurm.run("squeue", "--steps", "-h", "-j", job_id, "-o", "%N", check=False)
        step_nodes.update(listed.stdout.split())
        time.sleep(0.3)
    job = slurm.wait_job(job_id)
    output = job_output(run_dir, job_id)
    assert job["JobState"] == "COMPLETED" and job["ExitCode"] == "0:0", output + log_tails(run_dir)
    assert "inference on n1, trainer on n2" in output, output
    assert {"n1", "n2"} <= step_nodes, step_nodes  # srun steps ran on each node
    assert steps_with(run_dir, "loss") == [1, 2, 3, 4], output + log_tails(run_dir)
    assert "SIGKILL" not in output, output
    assert_bus_secured(run_dir)


def assert_bus_secured(run_dir: Path) -> None:
    """The sidecar served TLS only, with one user per role (docs/security.md): every service
    connected over tls:// as itself, and no credential is readable by others."""
    conf = json.loads((run_dir / "nats" / "nats-server.conf").read_text())
    assert conf["tls"]["cert_file"].endswith("server.pem")
    users = {u["user"] for u in conf["authorization"]["users"]}
    assert users >= {"trainer", "orchestrator", "inference", "monitor"}
    assert conf["http"].startswith("127.0.0.1:")  # monitoring stays on the node
    for service in ("monitor", "inference", "orchestrator", "trainer"):
        urls = {r["url"] for r in service_events(run_dir, service, "nats_connected")}
        assert urls and all(url.startswith("tls://") for url in urls), (service, urls)
    for path in [run_dir / "nats" / "nats-server.conf", *(run_dir / "secrets").rglob("*")]:
        if path.is_file() and path.suffix in (".conf", ".password", ".key"):
            assert path.stat().st_mode & 0o077 == 0, path


def test_scancel_batch_term_drains_the_job(slurm, tmp_path, starting_model):
    job_id, run_dir = submit(
        slurm, tmp_path, "slurm-drain", "--model.name", str(starting_model.path),
        "--max-steps", "200",
    )  # fmt: skip
    wait_for(lambda: steps_with(run_dir, "loss")[-1:] >= [2], 300, "two trained steps")
    slurm.run("scancel", "--batch", "--signal=TERM", job_id)
    job = slurm.wait_job(job_id, timeout_s=240)
    output = job_output(run_dir, job_id)
    assert "SIGTERM: draining" in output and "drained" in output, output
    assert "SIGKILL" not in output, output + log_tails(run_dir)
    assert job["ExitCode"] == "143:0", (job, output)  # the script's own exit after the drain
    for service in ("orchestrator", "inference", "monitor"):
        requests = service_events(run_dir, service, "service_stop_requested")
        assert [r["mode"] for r in requests][:1] == ["draining"], (service, requests)
