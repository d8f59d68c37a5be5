"""The processes of one RL run, decided once and written down before anything starts.

`build_rl_launch(config, run_dir)` turns a named `RLConfig` into:
- the resolved config of every service (`trainer`, `orchestrator`, `inference` or
  `inference-<i>` per replica), plus the resolved `rl` config itself, and
- the argv of every process, in launch order:

    nats          embedded nats-server (only without bus.url), store in <run_dir>/nats
    monitor       python -m rlbus_launch.monitor @ configs/rl.toml --bus.url <url>  (metrics.jsonl)
    inference     python -m rlbus_inference.entrypoint @ configs/inference.toml   (per replica;
                      with inference.attach an attach process per server: no vLLM, no ports)
    orchestrator  python -m rlbus_orchestrator.entrypoint @ configs/orchestrator.toml
    worker-<i>    the same with --role worker (deployment.num_rollout_workers, default none)
    trainer       python -m rlbus_trainer.entrypoint @ configs/trainer.toml   (one rank), or
                  python -m torch.distributed.run --standalone --nproc-per-node N
                      -m rlbus_trainer.entrypoint @ configs/trainer.toml   (N > 1 ranks)

Ports are picked here (free ports for the embedded server, the inference replicas and every
process's Prometheus /metrics) and written into the configs, so the scripts in the run directory
repeat this exact launch; `Launch.metrics` keeps where each process serves /metrics
(rlbus_launch.scrape lists them in `<run_dir>/metrics/targets.json`). A bus secret the launcher
got from its environment (RLBUS_BUS_TOKEN, RLBUS_BUS_PASSWORD) goes into `<run_dir>/secrets/` (0600) and the
configs name that file (`bus.token_file`): no secret in a config, a script or an argv. Services are only ever named as modules in
argv lists: the launcher imports none of them.
"""

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

from rlbus.configs import InferenceConfig, RLConfig
from rlbus.configs.bus import BusConfig
from rlbus.configs.common import ServiceConfig
from rlbus.configs.rl import gpu_placement
from rlbus.obs.logging import log_file_path
from rlbus.placement import GpuPlacement, detected_gpus, visible_devices
from rlbus.wire.subjects import RunSubjects
from rlbus_launch.cpus import (
    CpuPlan,
    bind_inference_env,
    bind_trainer,
    host_has_gpus,
    plan_cpus,
    under_taskset,
    usable_cores,
)
from rlbus_launch.scripts import config_path
from rlbus_launch.supervisor import ServiceProcess

NATS_STORE_DIR = "nats"
TRAINER_MODULE = "rlbus_trainer.entrypoint"
SECRETS_DIR = "secrets"
BUS_FILE = "bus.json"
"""`configs/bus.json`: where a run's bus is, for clients outside rlbus (docs/bus-messages.md)."""
CREDENTIAL_FIELDS = ("token_file", "user", "password_file", "creds_file", "nkey_seed_file")
TLS_FIELDS = ("tls_ca", "tls_cert", "tls_key")
CUDA_VISIBLE = "CUDA_VISIBLE_DEVICES"
"""Run-directory folder of the 0600 secret files the launcher writes for its children."""


@dataclass
class Launch:
    """Everything a launcher writes and starts."""

    config: RLConfig
    run_dir: Path
    configs: dict[str, ServiceConfig] = field(default_factory=dict)
    """`rl` (the launcher's own config) and each service's, by process name."""
    processes: list[ServiceProcess] = field(default_factory=list)
    files: dict[str, str] = field(default_factory=dict)
    """Other files for `configs/` (name with suffix -> text), e.g. `nats.conf`; written 0600
    (the embedded server's config holds its credentials)."""
    secret_files: dict[Path, str] = field(default_factory=dict)
    """0600 files (absolute path -> secret) the children read their bus credentials from."""
    config_files: list[Path] = field(default_factory=list)
    """Written by `write_launch`: configs/*.toml and the extra files."""
    script_files: list[Path] = field(default_factory=list)
    """Written by `write_launch`: scripts/<process>.sh, then scripts/launch.sh."""
    metrics: dict[str, str] = field(default_factory=dict)
    """process -> `host:port` of its Prometheus /metrics (services whose `metrics` is on)."""


def python_module_argv(module: str, config_file: Path) -> list[str]:
    return [sys.executable, "-m", module, "@", str(config_file)]


def torchrun_argv(num_procs: int, module: str, config_file: Path) -> list[str]:
    """torchrun through the interpreter (`-m torch.distributed.run`), so the launcher needs no
    torch import and no PATH lookup; `--standalone` picks a free rendezvous port."""
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        "--nproc-per-node", str(num_procs), "-m", module, "@", str(config_file),
    ]  # fmt: skip


def trainer_argv(num_procs: int, config_file: Path) -> list[str]:
    """The RL trainer on one node: one rank is the module itself, whose 1-rank process group
    needs no agent (torchrun's agent imports torch before it starts the rank: 1.3-1.7 s of a
    start-up the attached run waits for, docs/benchmarks.md); more ranks go through torchrun."""
    if num_procs == 1:
        return python_module_argv(TRAINER_MODULE, config_file)
    return torchrun_argv(num_procs, TRAINER_MODULE, config_file)


def embedded_nats(config: RLConfig, run_dir: Path) -> tuple[str, ServiceProcess, str]:
    """(url, process, config text) of the embedded nats-server whose store is in the run dir."""
    from rlbus_launch.natsserver import NatsServer, nats_server_binary

    server = NatsServer.for_config(config.bus, run_dir.absolute() / NATS_STORE_DIR)
    conf = config_path(run_dir, "nats").with_suffix(".conf")
    process = ServiceProcess(
        name="nats",
        argv=[nats_server_binary(), "-c", str(conf.absolute())],
        log_path=log_file_path(run_dir, "nats"),
        cwd=Path.cwd(),
    )
    return server.url, process, server.config_text()


def bus_file_text(bus: BusConfig, run_dir: Path, server_config: Path | None) -> str:
    """`configs/bus.json` of a run: its bus URL, run id as subjects spell it, subject prefix,
    claim-check root, the embedded server's config (None for an external bus) and the paths of
    the credential files the services use (paths only: never a secret)."""
    assert bus.url is not None and bus.run_id is not None
    subjects = RunSubjects(bus.run_id)
    fields = CREDENTIAL_FIELDS + TLS_FIELDS
    document = {
        "url": bus.url,
        "run": subjects.run_id,
        "prefix": subjects.prefix,
        "storage_dir": str(run_dir.absolute()),
        "server_config": str(server_config.absolute()) if server_config else None,
        "credentials": {name: getattr(bus, name) for name in fields if getattr(bus, name)},
    }
    return json.dumps(document, indent=2) + "\n"


def monitor_argv(config: RLConfig, run_dir: Path) -> list[str]:
    """The monitor reads the launcher's rl.toml, which keeps only explicit values (no embedded
    server URL), so the resolved bus URL and the paths of its secret files go on its command line
    (paths only: never a secret)."""
    argv = [
        sys.executable,
        "-m",
        "rlbus_launch.monitor",
        "@",
        str(config_path(run_dir, "rl").absolute()),
    ]
    argv += ["--bus.url", str(config.bus.url)]
    if config.bus.token_file is not None:
        argv += ["--bus.token-file", config.bus.token_file]
    if config.bus.password_file is not None:
        argv += ["--bus.password-file", config.bus.password_file]
    return argv


def bus_secret_files(bus: BusConfig, run_dir: Path) -> dict[Path, str]:
    """The secrets `bus` resolves from the launcher's environment (or memory), to be written as
    0600 files in the run directory; `bus` is pointed at those files. Secrets already in a file
    stay there (the config names it)."""
    files: dict[Path, str] = {}
    folder = run_dir.absolute() / SECRETS_DIR
    if bus.token_file is None and (token := bus.secret_token()) is not None:
        files[folder / "bus.token"] = token
        bus.token_file = str(folder / "bus.token")
    if bus.user and bus.password_file is None and (password := bus.secret_password()) is not None:
        files[folder / "bus.password"] = password
        bus.password_file = str(folder / "bus.password")
    return files


def pick_free_inference_ports(replica: InferenceConfig, user: InferenceConfig) -> None:
    """Ports the user did not set are picked free now (and written into the config), so two runs
    on one machine never fight over 8000/8100; ports set by file or flag are kept."""
    from rlbus.netutil import free_ports

    port, backend_port = free_ports(2)
    if "port" not in user.server.model_fields_set:
        replica.server.port = port
    if "backend_port" not in user.model_fields_set:
        replica.backend_port = backend_port


def inference_replicas(config: RLConfig) -> dict[str, InferenceConfig]:
    """One inference config per replica; replica i serves on port + i and backend_port + i
    (each a free port when the user set none)."""
    count = config.deployment.num_infer_replicas
    if config.inference.attach is not None:  # running servers: no vLLM, no ports of our own
        return attached_replicas(config.inference, count)
    if count == 1:
        replica = config.inference.model_copy(deep=True)
        pick_free_inference_ports(replica, config.inference)
        return {"inference": replica}
    replicas: dict[str, InferenceConfig] = {}
    for i in range(count):
        replica = config.inference.model_copy(deep=True)
        replica.server.port = config.inference.server.port + i
        replica.backend_port = config.inference.backend_port + i
        pick_free_inference_ports(replica, config.inference)
        replica.replica_id = replica.replica_id or str(i)
        replicas[f"inference-{i}"] = replica
    return replicas


def attached_replicas(inference: InferenceConfig, count: int) -> dict[str, InferenceConfig]:
    """One attach process per running server; server i on the attach URLs' ports + i and
    replica id i (the numbering of `inference_replicas`: own logs, own registry entries)."""
    if count == 1:
        return {"inference": inference.model_copy(deep=True)}
    attach = inference.attach
    assert attach is not None
    replicas = {}
    for i in range(count):
        replica = inference.model_copy(deep=True)
        replica.attach = attach.shifted(i)
        replica.replica_id = replica.replica_id or str(i)
        replicas[f"inference-{i}"] = replica
    return replicas


def fresh_ports(count: int, taken: set[int]) -> list[int]:
    """`count` distinct free ports, none of them in `taken` (ports planned already)."""
    from rlbus.netutil import free_ports

    while True:
        ports = free_ports(count)
        if not taken & set(ports):
            return ports


def plan_metrics_ports(services: dict[str, ServiceConfig], num_workers: int) -> dict[str, str]:
    """Give each process whose `metrics` is on a /metrics port of its own, written into its
    config: a free port, unless the service sets one itself (`--trainer.metrics.port 9101`;
    replica i serves on that port + i). Rollout workers share the orchestrator's config file, so
    their ports go on their command lines (`worker_metrics_argv`). Returns process -> `host:port`."""
    from rlbus.obs.metrics import host_port

    taken = {
        port
        for c in services.values()
        if isinstance(c, InferenceConfig)
        for port in (c.server.port, c.backend_port)
    }
    serving = {name: c.metrics for name, c in services.items() if c.metrics is not None}
    workers = [f"worker-{i}" for i in range(num_workers)] if "orchestrator" in serving else []
    free = iter(fresh_ports(len(serving) + len(workers), taken))
    addresses = {}
    for name, metrics in serving.items():
        own = "metrics" in services[name].model_fields_set and metrics.port != 0
        offset = int(name.removeprefix("inference-")) if name.startswith("inference-") else 0
        metrics.port = metrics.port + offset if own else next(free)
        addresses[name] = host_port(metrics.host, metrics.port)
    for name in workers:
        addresses[name] = host_port(serving["orchestrator"].host, next(free))
    return addresses


def worker_metrics_argv(launch: Launch, index: int) -> list[str]:
    """`--metrics.port N` of rollout-worker process `worker-<index>` (none: metrics are off)."""
    address = launch.metrics.get(f"worker-{index}")
    return [] if address is None else ["--metrics.port", address.rpartition(":")[2]]


def service_configs(config: RLConfig) -> dict[str, ServiceConfig]:
    """Resolved configs of the services (`clean` and `dry_run` are launcher fields the services do
    not have: a service never wipes or merely plans its run)."""
    trainer = config.trainer.model_copy(deep=True)
    orchestrator = config.orchestrator.model_copy(deep=True)
    return {**inference_replicas(config), "orchestrator": orchestrator, "trainer": trainer}


def orchestrator_cores(config: RLConfig, cpus: CpuPlan) -> list[int] | None:
    """The cores `deployment.orchestrator_cpus` pins the orchestrator and its workers to."""
    where = config.deployment.orchestrator_cpus
    if where == "inference":
        return cpus.inference[0]
    return cpus.trainer if where == "trainer" else None


def launcher_config(config: RLConfig) -> RLConfig:
    """`configs/rl.toml`: the user's intent (no bus.url: "start an embedded server"), so that
    `rl @ <run_dir>/configs/rl.toml --resume` starts one again; the services get the URL."""
    resolved_rl = config.model_copy(deep=True)
    resolved_rl.dry_run = False
    resolved_rl.clean = False
    return resolved_rl


def resolve_bus(
    config: RLConfig, run_dir: Path
) -> tuple[list[ServiceProcess], dict[str, str], dict[Path, str]]:
    """Point `config.bus` at the run's bus and push it down to the services. Returns the
    embedded server's process (none for a given bus.url), the files for `configs/` (its
    `nats.conf`, `bus.json`) and the 0600 secret files of the services' credentials."""
    processes: list[ServiceProcess] = []
    files: dict[str, str] = {}
    if config.bus.url is None:
        url, nats, nats_conf = embedded_nats(config, run_dir)
        config.bus.url = url
        processes.append(nats)
        files["nats.conf"] = nats_conf
    # after the embedded server took the secrets from the environment: from here on the
    # services read them from the run directory's 0600 files
    secret_files = bus_secret_files(config.bus, run_dir)
    config.push_shared_values_down()
    server_config = (
        config_path(run_dir, "nats").with_suffix(".conf") if "nats.conf" in files else None
    )
    files[BUS_FILE] = bus_file_text(config.bus, run_dir, server_config)
    return processes, files, secret_files


def planned_gpus(config: RLConfig) -> GpuPlacement | None:
    """The GPUs of each replica and of the trainer (rlbus.placement): over `deployment.gpu_ids`,
    else the GPUs detected; None on a host without GPUs where the config names none."""
    deployment = config.deployment
    gpu_ids = deployment.gpu_ids if deployment.gpu_ids is not None else detected_gpus()
    named = deployment.infer_gpu_ids is not None or deployment.train_gpu_ids is not None
    if not gpu_ids and not named:
        return None
    return gpu_placement(config, gpu_ids)


def planned_cpus(config: RLConfig, gpus: GpuPlacement | None) -> CpuPlan | None:
    """The cores of each service, when `deployment.cpu_binding` is on and the run has no GPUs."""
    if config.deployment.cpu_binding == "off" or gpus is not None or host_has_gpus():
        return None
    deployment = config.deployment
    return plan_cpus(usable_cores(), deployment.num_infer_replicas, deployment.num_train_gpus)


def service_process(
    name: str, argv: list[str], run_dir: Path, env: dict[str, str] | None = None
) -> ServiceProcess:
    """Process `name` run from the current directory, its output in `logs/<name>.log`."""
    log_path = log_file_path(run_dir, name)
    return ServiceProcess(name=name, argv=argv, log_path=log_path, env=env or {}, cwd=Path.cwd())


def trainer_process(
    config: RLConfig, launch: Launch, cpus: CpuPlan | None, gpus: GpuPlacement | None
) -> ServiceProcess:
    """The trainer: one rank, or torchrun over `deployment.num_train_gpus` ranks; on its own
    GPUs (one per rank) or cores."""
    path = config_path(launch.run_dir, "trainer").absolute()
    argv = trainer_argv(config.deployment.num_train_gpus, path)
    env: dict[str, str] = {}
    if cpus is not None:
        argv, env = bind_trainer(argv, cpus)
    if gpus is not None:
        env[CUDA_VISIBLE] = visible_devices(gpus.trainer)
    return service_process("trainer", argv, launch.run_dir, env)


def orchestrator_processes(
    config: RLConfig, launch: Launch, cpus: CpuPlan | None
) -> list[ServiceProcess]:
    """The rollout workers (the orchestrator's argv with `--role worker`), then the
    orchestrator; all on the orchestrator's cores."""
    path = config_path(launch.run_dir, "orchestrator").absolute()
    argv = python_module_argv("rlbus_orchestrator.entrypoint", path)
    if cpus is not None and (cores := orchestrator_cores(config, cpus)) is not None:
        argv = under_taskset(argv, cores)
    processes = [
        service_process(
            f"worker-{i}",
            [*argv, *worker_metrics_argv(launch, i), "--role", "worker"],
            launch.run_dir,
        )
        for i in range(config.deployment.num_rollout_workers)
    ]
    return [*processes, service_process("orchestrator", argv, launch.run_dir)]


def inference_process(
    config: RLConfig, name: str, run_dir: Path, cores: list[int] | None, gpus: tuple[int, ...]
) -> ServiceProcess:
    """Inference replica `name`; with `cores`, its engine's threads bound to them (and the
    process too, with `cpu_binding = "auto"`); with `gpus`, it sees only those devices. An
    attach process runs no vLLM: never bound."""
    argv = python_module_argv("rlbus_inference.entrypoint", config_path(run_dir, name).absolute())
    env: dict[str, str] = {}
    if config.inference.attach is not None:
        return service_process(name, argv, run_dir, env)
    if cores is not None:
        env = bind_inference_env(cores)
        if config.deployment.cpu_binding == "auto":
            argv = under_taskset(argv, cores)
    if gpus:
        env[CUDA_VISIBLE] = visible_devices(gpus)
    return service_process(name, argv, run_dir, env)


def service_processes(
    config: RLConfig, launch: Launch, names: list[str], gpus: GpuPlacement | None
) -> list[ServiceProcess]:
    """The processes of the services `names` (inference replicas, orchestrator, trainer), each on
    its own GPUs (`gpus`) or, on a CPU host, its own cores."""
    processes: list[ServiceProcess] = []
    cpus = planned_cpus(config, gpus)
    replicas = [name for name in names if name not in ("orchestrator", "trainer")]
    for index, name in enumerate(replicas):
        cores = cpus.inference[index] if cpus is not None else None
        devices = gpus.inference[index] if gpus is not None else ()
        processes.append(inference_process(config, name, launch.run_dir, cores, devices))
    if "orchestrator" in names:
        processes += orchestrator_processes(config, launch, cpus)
    if "trainer" in names:
        processes.append(trainer_process(config, launch, cpus, gpus))
    return processes


LAUNCH_ORDER = {"nats": 0, "monitor": 0.5, "orchestrator": 2, "trainer": 3}
"""Inference first (1), then orchestrator, its workers (2.5) and trainer (DESIGN.md); nats and
the monitor (a durable consumer, so it misses nothing) before all of them; stopping goes in
reverse."""


def in_launch_order(processes: list[ServiceProcess]) -> list[ServiceProcess]:
    return sorted(
        processes,
        key=lambda p: 2.5 if p.name.startswith("worker-") else LAUNCH_ORDER.get(p.name, 1),
    )


def build_rl_launch(config: RLConfig, run_dir: Path) -> Launch:
    """Resolve the bus, the service configs and the argv of every process of an RL run."""
    assert config.run.name is not None, "name the run (RLConfig.with_run_name) before planning it"
    resolved_rl = launcher_config(config)
    config = config.model_copy(deep=True)
    processes, files, secret_files = resolve_bus(config, run_dir)
    launch = Launch(config=resolved_rl, run_dir=run_dir, files=files, secret_files=secret_files)
    launch.configs["rl"] = resolved_rl
    services = service_configs(config)
    launch.metrics = plan_metrics_ports(services, config.deployment.num_rollout_workers)
    launch.configs.update(services)
    processes.append(service_process("monitor", monitor_argv(config, run_dir), run_dir))
    processes += service_processes(config, launch, list(services), planned_gpus(config))
    launch.processes = in_launch_order(processes)
    return launch
