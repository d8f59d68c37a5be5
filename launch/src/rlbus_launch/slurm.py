"""`--slurm`: a run as one sbatch script in its run directory, submitted with `sbatch`.

`rl`, `sft` and `inference` call in here instead of starting anything when their config has a
`[slurm]` section (or `--slurm`). Everything is decided at render time, on the submitting host:

    <run_dir>/configs/*.toml          resolved per-service configs, as `rl --dry-run` writes them
    <run_dir>/slurm/<name>.sbatch     the job: absolute paths only (SLURM runs a spool copy, so
                                      nothing may be found through $0)
    <run_dir>/slurm/<name>-<jobid>.out   the job's own output (start/stop lines, exit codes)

The job starts every service from those configs with `--bus.url` of the sidecar NATS on the first
node, and every long-running service with `--exit-when-finished`, so the job ends by itself once
the trainer has trained its last step. On SIGTERM (`scancel --batch --signal=TERM`, or SLURM's
`--signal=B:TERM@...` before the time limit) the script drains: SIGTERM to the orchestrator,
workers and trainer, up to `grace_s`; then inference and the monitor; NATS last. A requeued job runs
the same script again: same run directory, same NATS store, and the services resume by themselves
(docs/run-directories.md, "Restarts without --resume"). The run-directory rules are applied once,
here, at submit time: the script never creates or checks the NATS store itself.

The sidecar is authenticated and encrypted: at submit time `<run_dir>/secrets/nats/` (0700) gets
a CA, one password per role and the permissions (rlbus.bus.natsauth); at job start the sidecar
issues its server certificate for the first node's address, serves TLS only, and every service
connects as its own user (`--bus.user ROLE --bus.password-file ...`: paths, never a secret).
"""

import shlex
import shutil
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import structlog
from pydantic import BaseModel

from rlbus.bus.natsauth import client_flags, write_security_dir
from rlbus.configs import InferenceConfig, OrchestratorConfig, RLConfig, SFTConfig, SlurmConfig
from rlbus.configs.base import parse_cli
from rlbus.configs.common import ServiceConfig
from rlbus.configs.rl import gpu_placement
from rlbus.placement import PlacementError, place_gpus
from rlbus.rundirs import run_id_of
from rlbus.secrets import write_secret_file
from rlbus_launch.plan import (
    NATS_STORE_DIR,
    SECRETS_DIR,
    Launch,
    build_rl_launch,
    python_module_argv,
    torchrun_argv,
    trainer_argv,
)
from rlbus_launch.scripts import config_path, write_configs

log = structlog.get_logger()

SLURM_DIR = "slurm"
BUS_URL = '"$BUS_URL"'
"""Shell text of the bus URL the script computes (the sidecar on the first node)."""
SIGNAL_MARGIN_S = 30
"""Added to the drain time when asking SLURM for the SIGTERM before the time limit."""

STOP_FIRST, STOP_SECOND, STOP_LAST = 0, 1, 2
"""Stop groups: orchestrator/workers/trainer drain first, then inference and the monitor, NATS last."""


class SlurmSetupError(ValueError):
    """A `[slurm]` value that cannot work; the message names the field and the fix."""


@dataclass
class Step:
    """One process the job starts: a shell command line (already quoted), its stop group, and
    whether the trainer's exit ends the job."""

    name: str
    command: str
    group: int
    main: bool = False


@dataclass
class Job:
    """Everything one sbatch script holds."""

    name: str
    run_dir: Path
    slurm: SlurmConfig
    steps: list[Step] = field(default_factory=list)
    nats: str | None = None
    """The sidecar's command (None: bus.url was given, or no bus at all)."""
    bus_url: str | None = None
    """A bus.url given by the user (then no sidecar)."""
    nats_http_port: int | None = None
    security_dir: Path | None = None
    """The sidecar's users, permissions and CA (written at submit time)."""
    run_id: str | None = None
    secret_files: dict[Path, str] = field(default_factory=dict)
    """0600 files with the credentials of a given bus.url (rlbus_launch.plan.bus_secret_files)."""
    node_lines: list[str] = field(default_factory=list)
    """Bash lines that name the nodes of each role (multi-node jobs)."""

    @property
    def script_path(self) -> Path:
        return self.run_dir / SLURM_DIR / f"{self.name}.sbatch"

    @property
    def output_pattern(self) -> Path:
        return self.run_dir / SLURM_DIR / f"{self.name}-%j.out"


# ---- rendering ---------------------------------------------------------------------------------


def sbatch_directives(job: Job, job_name: str) -> list[str]:
    """The `#SBATCH` lines: allocation, output, drain signal, requeue, then the user's extras."""
    s = job.slurm
    grace = 3 * s.grace_s + SIGNAL_MARGIN_S
    lines = [
        f"--job-name={job_name}",
        f"--nodes={s.nodes}",
        "--ntasks-per-node=1",
        f"--output={job.output_pattern.absolute()}",
        "--open-mode=append",
        f"--signal=B:TERM@{grace}",
        "--requeue" if s.requeue else "--no-requeue",
    ]
    for flag, value in (("partition", s.partition), ("account", s.account), ("time", s.time)):
        if value is not None:
            lines.append(f"--{flag}={value}")
    if s.gpus_per_node:
        lines.append(f"--gpus-per-node={s.gpus_per_node}")
    if s.exclusive:
        lines.append("--exclusive")
    lines += s.directives
    return [f"#SBATCH {line}" for line in lines]


RUNTIME = r"""
pids=(); names=(); groups=(); reaped=()
start() {  # start GROUP NAME CMD...: CMD in the background, output appended to logs/NAME.log
  local group=$1 name=$2; shift 2
  "$@" >> "$RUN_DIR/logs/$name.log" 2>&1 &
  pids+=("$!"); names+=("$name"); groups+=("$group")
  say "started $name (pid $!, log $RUN_DIR/logs/$name.log)"
}
say() { echo "$(date -u +%H:%M:%S) rlbus-slurm: $*"; }
alive() { kill -0 "$1" 2>/dev/null && [ "$(ps -o stat= -p "$1" 2>/dev/null | cut -c1)" != Z ]; }
await_group() {  # await_group GROUP SECONDS: wait that long for every process of GROUP to exit
  local i deadline=$((SECONDS + $2))
  for i in "${!pids[@]}"; do
    [ "${groups[i]}" = "$1" ] || continue
    while alive "${pids[i]}" && [ "$SECONDS" -lt "$deadline" ]; do sleep 1; done
  done
}
stop_group() {  # SIGTERM every live process of GROUP, GRACE_S for them to drain, then SIGKILL
  local i
  for i in "${!pids[@]}"; do
    [ "${groups[i]}" = "$1" ] && alive "${pids[i]}" && kill -TERM "${pids[i]}" && say "SIGTERM ${names[i]}"
  done
  await_group "$1" "$GRACE_S"
  for i in "${!pids[@]}"; do
    [ "${groups[i]}" = "$1" ] && alive "${pids[i]}" && kill -KILL "${pids[i]}" &&
      say "${names[i]} still running after ${GRACE_S} s: SIGKILL"
  done
}
stop_all() { trap '' TERM INT; stop_group 0; stop_group 1; stop_group 2; }
node_addr() {  # the address SLURM reaches a node at (NodeAddr; the node name when unset)
  local addr
  addr=$(scontrol show node -o "$1" | tr ' ' '\n' | sed -n 's/^NodeAddr=//p')
  echo "${addr:-$1}"
}
wait_for_nats() {  # the sidecar's JetStream health endpoint, up to 120 s
  local i
  for i in $(seq 240); do
    "$PYTHON" -c "import urllib.request as u; u.urlopen('$1', timeout=2)" 2>/dev/null && return 0
    alive "${pids[0]}" || { say "nats exited before it was healthy"; return 1; }
    sleep 0.5
  done
  say "nats not healthy after 120 s: $1"; return 1
}
run_until_main_exits() {  # the main step's exit ends the wait; another step failing fails the job
  local i code  # polled once a second: bash 4.4 (RHEL 8) has no `wait -n -p`
  while :; do
    for i in "${!pids[@]}"; do
      [ -z "${reaped[i]:-}" ] && ! alive "${pids[i]}" || continue
      wait "${pids[i]}"; code=$?; reaped[i]=1
      say "${names[i]} exited with code $code"
      if [ "${names[i]}" = "$MAIN" ]; then return "$code"; fi
      if [ "$code" -ne 0 ]; then stop_all; exit "$code"; fi
    done
    sleep 1
  done
}
"""


def render_script(job: Job, command: str) -> str:
    """The whole sbatch script of `job` (bash)."""
    s = job.slurm
    job_name = s.job_name or f"{job.name}-{job.run_dir.name}"
    lines = [
        "#!/bin/bash",
        *sbatch_directives(job, job_name),
        f"# Written by `{command}` at {datetime.now(UTC):%Y-%m-%d %H:%M:%S} UTC (docs/slurm.md).",
        f"# Submit again: sbatch {job.script_path.absolute()}",
        "# Stop with a drain: scancel --batch --signal=TERM <jobid>",
        "set -uo pipefail",
        f"cd {shlex.quote(str(Path.cwd()))}",
        f"RUN_DIR={shlex.quote(str(job.run_dir.absolute()))}",
        f"PYTHON={shlex.quote(sys.executable)}",
        f"GRACE_S={s.grace_s}",
        f"MAIN={next(step.name for step in job.steps if step.main)}",
        RUNTIME.strip("\n"),
        *s.setup,
        'mkdir -p "$RUN_DIR/logs"',
        'mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")',
        'say "job $SLURM_JOB_ID on ${NODES[*]} (restart ${SLURM_RESTART_COUNT:-0})"',
        *job.node_lines,
        'trap \'say "SIGTERM: draining"; stop_all; say "drained"; exit 143\' TERM',
    ]
    lines += bus_lines(job)
    for step in job.steps:
        lines.append(f"start {step.group} {step.name} {step.command}")
    lines += [
        "run_until_main_exits; code=$?",
        "# the others end by themselves (--exit-when-finished); stop whoever does not",
        'for g in 0 1 2; do await_group "$g" "$GRACE_S"; stop_group "$g"; done',
        'say "done, exit code $code"',
        'exit "$code"',
    ]
    return "\n".join(lines) + "\n"


def bus_lines(job: Job) -> list[str]:
    """Start the NATS sidecar on the first node (or use the given bus.url) and set BUS_URL."""
    if job.nats is None:
        return [f"BUS_URL={shlex.quote(job.bus_url)}"] if job.bus_url else []
    port = job.slurm.nats_port
    return [
        'HEAD_ADDR=$(node_addr "${NODES[0]}")',
        f'BUS_URL="tls://$HEAD_ADDR:{port}"',
        f"start {STOP_LAST} nats {job.nats}",
        f'wait_for_nats "http://127.0.0.1:{job.nats_http_port}/healthz?js-enabled-only=true"'
        " || { stop_all; exit 1; }",
        'say "nats ready at $BUS_URL"',
    ]


def srun_on(nodes_var: str, count: str, slurm: SlurmConfig) -> str:
    """An srun prefix for one task on each node of a bash array: explicit task counts (never
    inherited from the batch step's SLURM_NTASKS), --overlap so it shares the nodes with the
    other steps, and the whole node's CPUs (and GPUs)."""
    parts = [
        "srun",
        f"--nodes={count}",
        f"--ntasks={count}",
        "--ntasks-per-node=1",
        f'--nodelist="$(IFS=,; echo "${{{nodes_var}[*]}}")"',
        "--overlap",
        "--kill-on-bad-exit=1",
        '--cpus-per-task="$SLURM_CPUS_ON_NODE"',
    ]
    if slurm.gpus_per_node:
        parts.append(f"--gpus-per-node={slurm.gpus_per_node}")
    return " ".join(parts)


def with_devices(argv_text: str, devices: list[int] | None) -> str:
    """Prefix `env CUDA_VISIBLE_DEVICES=...` when the process gets its own GPUs."""
    if devices is None:
        return argv_text
    return f"env CUDA_VISIBLE_DEVICES={','.join(map(str, devices))} {argv_text}"


def multi_node_torchrun(nnodes: int, nproc: int, module: str, config: Path, port: int) -> str:
    """torchrun across nodes: c10d rendezvous on `$RDZV` (the first trainer node's address),
    one rendezvous per job id."""
    head = shlex.join([
        sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes),
        "--nproc-per-node", str(nproc), "--rdzv-backend", "c10d",
    ])  # fmt: skip
    tail = shlex.join(["-m", module, "@", str(config.absolute())])
    return f'{head} --rdzv-endpoint "$RDZV:{port}" --rdzv-id "$SLURM_JOB_ID" {tail}'


def rendezvous_line(nodes_var: str) -> str:
    return f'RDZV=$(node_addr "${{{nodes_var}[0]}}")'


# ---- rl ----------------------------------------------------------------------------------------


def node_gpu_ids(config: RLConfig, slurm: SlurmConfig) -> list[int]:
    """The GPUs of one node of the job: `deployment.gpu_ids`, else 0..gpus_per_node-1 (SLURM
    numbers a step's devices from 0)."""
    if config.deployment.gpu_ids is not None:
        return list(config.deployment.gpu_ids)
    return list(range(slurm.gpus_per_node))


def one_node_gpus(
    config: RLConfig, slurm: SlurmConfig
) -> tuple[list[list[int] | None], list[int] | None]:
    """(devices of each inference replica, trainer devices) on a single node, by the launcher's
    own rule (rlbus.placement); None each on CPU nodes."""
    if not slurm.gpus_per_node:
        return [None] * config.deployment.num_infer_replicas, None
    try:
        placement = gpu_placement(config, node_gpu_ids(config, slurm))
    except PlacementError as error:
        raise SlurmSetupError(f"{error} (slurm.gpus_per_node = {slurm.gpus_per_node})") from None
    return [list(r) for r in placement.inference], list(placement.trainer)


def multi_node_gpus(config: RLConfig, slurm: SlurmConfig) -> list[list[int] | None]:
    """Devices of each inference replica on an inference node (every replica runs on each
    inference node, tensor_parallel_size GPUs each); a trainer node's GPUs all go to its
    torchrun."""
    replicas, train = config.deployment.num_infer_replicas, config.deployment.num_train_gpus
    if not slurm.gpus_per_node:
        return [None] * replicas
    if train > slurm.gpus_per_node:
        raise SlurmSetupError(
            f"deployment.num_train_gpus ({train}) exceeds slurm.gpus_per_node "
            f"({slurm.gpus_per_node}): on several nodes it is the trainer ranks per trainer node"
        )
    try:
        placement = place_gpus(
            node_gpu_ids(config, slurm),
            num_replicas=replicas,
            tensor_parallel_size=config.inference.vllm.tensor_parallel_size,
            num_train_gpus=0,
            infer_gpu_ids=config.deployment.infer_gpu_ids,
        )
    except PlacementError as error:
        raise SlurmSetupError(f"{error} (on each inference node)") from None
    return [list(r) for r in placement.inference]


def node_split(slurm: SlurmConfig) -> tuple[int, int]:
    """(inference nodes, trainer nodes) of a multi-node rl job."""
    trainers = slurm.nodes - slurm.inference_nodes
    if trainers < 1:
        raise SlurmSetupError(
            f"slurm.nodes ({slurm.nodes}) leaves no trainer node after slurm.inference_nodes "
            f"({slurm.inference_nodes}): raise --slurm.nodes or lower --slurm.inference-nodes"
        )
    return slurm.inference_nodes, trainers


def security_dir_of(run_dir: Path) -> Path:
    return run_dir.absolute() / SECRETS_DIR / "nats"


def nats_command(run_dir: Path, config: RLConfig, slurm: SlurmConfig) -> str:
    """`rlbus-nats` on every interface of the first node, store in `<run_dir>/nats` (it creates
    the store itself; a requeued job reopens it), exiting once the run is finished. TLS with
    per-role users; the server certificate is issued at start for the node's address."""
    argv = [
        str(Path(sys.executable).parent / "rlbus-nats"),
        "--store", str(run_dir.absolute() / NATS_STORE_DIR),
        "--host", "0.0.0.0", "--port", str(slurm.nats_port),
        "--http-port", str(slurm.nats_http_port),
        "--max-payload-mb", str(config.bus.max_payload_mb),
        "--run-id", str(run_id_of(config.bus.run_id, config.run.name)),
        "--exit-when-finished",
        "--security-dir", str(security_dir_of(run_dir)),
    ]  # fmt: skip
    return shlex.join(argv) + ' --tls-host "$HEAD_ADDR" --tls-host "${NODES[0]}"'


def bus_flags(job: Job, role: str) -> list[str]:
    """How a step connects: as `role` of the sidecar (paths only), or as the user configured
    for a given bus.url (from the resolved config)."""
    return client_flags(job.security_dir, role) if job.security_dir is not None else []


def service_command(argv: list[str], extra: list[str] | None = None) -> str:
    """A service's argv, then `--bus.url "$BUS_URL"` (the URL is only known on the node)."""
    return shlex.join([*argv, *(extra or [])]) + f" --bus.url {BUS_URL}"


def planned_launch(config: RLConfig, slurm: SlurmConfig, run_dir: Path) -> Launch:
    """The run planned as `rl` plans it, without `[slurm]`; with no bus.url the services name
    the sidecar's port (the script passes its real address on every command line)."""
    planned = config.model_copy(deep=True)
    planned.slurm = None
    if config.bus.url is None:
        planned.bus = planned.bus.model_copy(update={"url": f"nats://127.0.0.1:{slurm.nats_port}"})
    return build_rl_launch(planned, run_dir)


def launcher_config(config: RLConfig) -> RLConfig:
    """`configs/rl.toml` of the job: `[slurm]` kept, so `rl @ rl.toml --resume` resubmits."""
    launcher = config.model_copy(deep=True)
    launcher.dry_run = False
    launcher.clean = False
    return launcher


def gpus_of_steps(
    config: RLConfig, slurm: SlurmConfig
) -> tuple[list[list[int] | None], list[int] | None]:
    """(devices of each inference replica, trainer devices: None on several nodes, where a
    trainer node's GPUs all go to its torchrun)."""
    if slurm.nodes > 1:
        return multi_node_gpus(config, slurm), None
    return one_node_gpus(config, slurm)


def adapt_configs_to_nodes(
    configs: dict[str, ServiceConfig], config: RLConfig, replicas: list[str], num_train_nodes: int
) -> None:
    """Ports the user did not set become free ports of the node (claim_ports; /metrics ones are
    named in each service's `metrics_serving` log line); replicas and the orchestrator exit
    once the run is finished; the orchestrator counts the trainer ranks of every node."""
    for name in replicas:
        replica = configs[name]
        assert isinstance(replica, InferenceConfig)
        if "port" not in config.inference.server.model_fields_set:
            replica.server.port = 0
        if "backend_port" not in config.inference.model_fields_set:
            replica.backend_port = 0
        replica.exit_when_finished = True
    for name in (*replicas, "orchestrator", "trainer"):
        service = configs[name]
        if service.metrics is not None and "metrics" not in service.model_fields_set:
            service.metrics.port = 0
    orchestrator = configs["orchestrator"]
    assert isinstance(orchestrator, OrchestratorConfig)
    orchestrator.exit_when_finished = True
    if "num_train_ranks" not in config.orchestrator.model_fields_set:
        orchestrator.num_train_ranks = num_train_nodes * config.deployment.num_train_gpus


def new_rl_job(config: RLConfig, slurm: SlurmConfig, run_dir: Path, launch: Launch) -> Job:
    """The job without steps: the given bus.url and its secret files, or the sidecar."""
    job = Job(name="rl", run_dir=run_dir, slurm=slurm, bus_url=config.bus.url)
    job.secret_files = launch.secret_files
    if config.bus.url is None:
        job.nats = nats_command(run_dir, config, slurm)
        job.nats_http_port = slurm.nats_http_port
        job.security_dir = security_dir_of(run_dir)
        job.run_id = run_id_of(config.bus.run_id, config.run.name)
    return job


def add_monitor_step(job: Job) -> None:
    monitor = [
        sys.executable,
        "-m",
        "rlbus_launch.monitor",
        "@",
        str(config_path(job.run_dir, "rl").absolute()),
    ]
    monitor += ["--exit-when-finished", *bus_flags(job, "monitor")]
    job.steps.append(Step("monitor", service_command(monitor), STOP_SECOND))


def add_inference_steps(
    job: Job, replicas: list[str], devices: list[list[int] | None], num_infer_nodes: int
) -> None:
    """One step per replica (on several nodes: an srun over the inference nodes)."""
    for name, replica_devices in zip(replicas, devices, strict=True):
        argv = python_module_argv(
            "rlbus_inference.entrypoint", config_path(job.run_dir, name).absolute()
        )
        text = with_devices(service_command(argv, bus_flags(job, "inference")), replica_devices)
        if job.slurm.nodes > 1:
            text = f"{srun_on('INFER_NODES', str(num_infer_nodes), job.slurm)} {text}"
        job.steps.append(Step(name, text, STOP_SECOND))


def add_orchestrator_steps(job: Job, num_rollout_workers: int) -> None:
    """The orchestrator and its rollout workers (the same argv with `--role worker`)."""
    orch_argv = python_module_argv(
        "rlbus_orchestrator.entrypoint", config_path(job.run_dir, "orchestrator").absolute()
    )
    orch_flags = bus_flags(job, "orchestrator")
    job.steps.append(Step("orchestrator", service_command(orch_argv, orch_flags), STOP_FIRST))
    for i in range(num_rollout_workers):
        worker_flags = ["--role", "worker", *bus_flags(job, "worker")]
        job.steps.append(Step(f"worker-{i}", service_command(orch_argv, worker_flags), STOP_FIRST))


def add_trainer_step(
    job: Job, num_train_gpus: int, devices: list[int] | None, num_train_nodes: int
) -> None:
    """The trainer, the job's main step: one torchrun per trainer node on several nodes."""
    slurm = job.slurm
    trainer_config = config_path(job.run_dir, "trainer").absolute()
    if slurm.nodes > 1:
        torchrun = multi_node_torchrun(
            num_train_nodes, num_train_gpus, "rlbus_trainer.entrypoint", trainer_config,
            slurm.rdzv_port,
        )  # fmt: skip
        flags = shlex.join(bus_flags(job, "trainer"))
        srun = srun_on("TRAIN_NODES", str(num_train_nodes), slurm)
        text = f"{srun} {torchrun} {flags} --bus.url {BUS_URL}"
    else:
        argv = trainer_argv(num_train_gpus, trainer_config)
        text = with_devices(service_command(argv, bus_flags(job, "trainer")), devices)
    job.steps.append(Step("trainer", text, STOP_FIRST, main=True))


def multi_node_lines(num_infer_nodes: int) -> list[str]:
    """Bash lines naming the inference nodes (the first ones) and the trainer nodes."""
    return [
        f'INFER_NODES=("${{NODES[@]:0:{num_infer_nodes}}}")',
        f'TRAIN_NODES=("${{NODES[@]:{num_infer_nodes}}}")',
        rendezvous_line("TRAIN_NODES"),
        'say "inference on ${INFER_NODES[*]}, trainer on ${TRAIN_NODES[*]} (rendezvous $RDZV)"',
    ]


def rl_job(config: RLConfig, run_dir: Path) -> tuple[Job, dict[str, ServiceConfig]]:
    """The resolved configs and the job of a named RL run."""
    slurm = config.slurm
    assert slurm is not None
    launch = planned_launch(config, slurm, run_dir)
    configs = launch.configs
    configs["rl"] = launcher_config(config)
    multi = slurm.nodes > 1
    num_infer_nodes, num_train_nodes = node_split(slurm) if multi else (1, 1)
    replicas = [name for name in configs if name.startswith("inference")]
    infer_devices, train_devices = gpus_of_steps(config, slurm)
    adapt_configs_to_nodes(configs, config, replicas, num_train_nodes)

    job = new_rl_job(config, slurm, run_dir, launch)
    add_monitor_step(job)
    add_inference_steps(job, replicas, infer_devices, num_infer_nodes)
    add_orchestrator_steps(job, config.deployment.num_rollout_workers)
    add_trainer_step(job, config.deployment.num_train_gpus, train_devices, num_train_nodes)
    if multi:
        job.node_lines = multi_node_lines(num_infer_nodes)
    return job, configs


# ---- sft and inference -------------------------------------------------------------------------


def sft_job(config: SFTConfig, run_dir: Path) -> Job:
    """One torchrun (one agent per node) of a named SFT run; no bus."""
    slurm = config.slurm
    assert slurm is not None
    path = config_path(run_dir, "sft").absolute()
    module = "rlbus_trainer.sft_entrypoint"
    job = Job(name="sft", run_dir=run_dir, slurm=slurm)
    if slurm.nodes > 1:
        torchrun = multi_node_torchrun(
            slurm.nodes, config.num_processes, module, path, slurm.rdzv_port
        )
        text = f"{srun_on('NODES', str(slurm.nodes), slurm)} {torchrun}"
        job.node_lines = [rendezvous_line("NODES")]
    else:
        text = shlex.join(torchrun_argv(config.num_processes, module, path))
    job.steps.append(Step("sft", text, STOP_FIRST, main=True))
    return job


def inference_job(config: InferenceConfig, run_dir: Path, name: str) -> Job:
    """One replica per node, each from the resolved `configs/<name>.toml`."""
    slurm = config.slurm
    assert slurm is not None
    argv = python_module_argv("rlbus_inference.entrypoint", config_path(run_dir, name).absolute())
    text = shlex.join(argv)
    if slurm.nodes > 1:
        text = f"{srun_on('NODES', str(slurm.nodes), slurm)} {text}"
    job = Job(name="inference", run_dir=run_dir, slurm=slurm, bus_url=config.bus.url)
    job.steps.append(Step(name, text, STOP_SECOND, main=True))
    return job


# ---- writing and submitting --------------------------------------------------------------------


def write_job(job: Job, command: str, configs: Mapping[str, BaseModel]) -> Path:
    """Write the resolved configs (without their `[slurm]`, so a service never resubmits) and
    the sbatch script; returns the script's path."""
    write_configs(job.run_dir, configs)
    for secret_path, secret in job.secret_files.items():
        write_secret_file(secret_path, secret)
    if job.security_dir is not None:  # the node's address goes in at job start (--tls-host)
        write_security_dir(job.security_dir, job.run_id or job.name, ["localhost", "127.0.0.1"])
    path = job.script_path
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_script(job, command))
    path.chmod(0o755)
    return path


def submit(job: Job, script: Path) -> int:
    """`sbatch` the script; print the job id, where its output goes and how to stop it.
    Returns the exit code of the command (0, or 1 when sbatch refused)."""
    sbatch = shutil.which("sbatch")
    if sbatch is None:
        print(
            f"sbatch is not on PATH: install SLURM's client commands (Debian: slurm-client), or "
            f"run with --dry-run (inference: --no-slurm.submit) and submit {script} where sbatch is",
            file=sys.stderr,
        )
        return 1
    result = subprocess.run([sbatch, "--parsable", str(script)], capture_output=True, text=True)
    if result.returncode != 0:
        message = (result.stderr or result.stdout).strip().splitlines()
        print(
            f"sbatch refused {script}: {message[-1] if message else result.returncode}",
            file=sys.stderr,
        )
        return 1
    job_id = result.stdout.strip().split(";")[0]
    output = str(job.output_pattern.absolute()).replace("%j", job_id)
    log.info("slurm_submitted", job_id=job_id, script=str(script), output=output)
    print(f"Submitted SLURM job {job_id}: {script}")
    print(f"Job output: {output}; service logs: {job.run_dir.absolute() / 'logs'}")
    print(f"Stop it with a drain: scancel --batch --signal=TERM {job_id}")
    return 0


def finish(job: Job, command: str, configs: Mapping[str, BaseModel], dry_run: bool) -> int:
    """Write the job, then submit it unless this is a dry run; returns the exit code."""
    script = write_job(job, command, configs)
    if dry_run or not job.slurm.submit:
        print(
            f"Run directory: {job.run_dir}\nSLURM script: {script}\nSubmit it with: sbatch {script}"
        )
        return 0
    return submit(job, script)


def report_setup_error(error: SlurmSetupError) -> int:
    print(f"--slurm: {error}", file=sys.stderr)
    return 2


def submit_rl(config: RLConfig, run_dir: Path, command: str) -> int:
    """`rl --slurm` for a named config whose run directory is prepared."""
    assert config.slurm is not None
    if config.slurm.requeue and config.ckpt is None:
        log.warning("slurm_requeue_without_ckpt", hint="a requeued trainer needs [ckpt] to resume")
    try:
        job, configs = rl_job(config, run_dir)
    except SlurmSetupError as error:
        return report_setup_error(error)
    return finish(job, command, configs, config.dry_run)


def submit_sft(config: SFTConfig, resolved: SFTConfig, run_dir: Path, command: str) -> int:
    """`sft --slurm` for a named config whose run directory is prepared."""
    job = sft_job(config, run_dir)
    return finish(job, command, {"sft": resolved}, config.dry_run)


INFERENCE_CONFIG = "inference-slurm"
"""The resolved config of `inference --slurm` (not `inference.toml`: that one is `rl`'s)."""


def submit_inference(config: InferenceConfig, command: str) -> int:
    """`inference --slurm`: needs run_dir (the script, its output and the logs go there)."""
    if config.run_dir is None:
        print(
            "inference --slurm: run_dir is not set; pass --run-dir <the run directory to join> "
            "(the sbatch script, its output and the replica logs go there)",
            file=sys.stderr,
        )
        return 2
    run_dir = Path(config.run_dir)
    resolved = config.model_copy(deep=True)
    resolved.slurm = None
    if "port" not in config.server.model_fields_set:
        resolved.server.port = 0
    if "backend_port" not in config.model_fields_set:
        resolved.backend_port = 0
    resolved.exit_when_finished = config.bus.url is not None
    job = inference_job(config, run_dir, INFERENCE_CONFIG)
    return finish(job, command, {INFERENCE_CONFIG: resolved}, dry_run=False)


def main(argv: list[str]) -> int:
    """`python -m rlbus_launch.slurm ARGS...`: what `inference --slurm ARGS...` execs."""
    config = parse_cli(InferenceConfig, argv, prog="inference")
    return submit_inference(config, "inference " + " ".join(argv))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
