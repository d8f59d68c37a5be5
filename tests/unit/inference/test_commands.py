"""Unit tests of the inference service's pure parts: child commands, registry entries."""

import subprocess
import sys
import threading
import time

import pytest

from rlbus.configs.inference import InferenceConfig
from rlbus_inference import engine_process, patches, replica


def make_config(**overrides) -> InferenceConfig:
    return InferenceConfig(**overrides)


def test_engine_command_passes_vllm_options_and_worker_extension():
    config = make_config(
        backend_port=9100,
        vllm={"model": "/m", "max_model_len": 128, "enforce_eager": True, "max_num_seqs": 4},
    )
    command = engine_process.engine_command(config)
    assert command[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert command[command.index("--port") + 1] == "9100"
    assert command[command.index("--worker-extension-cls") + 1] == engine_process.WORKER_EXTENSION
    assert command[command.index("--model") + 1] == "/m"
    assert command[command.index("--max-num-seqs") + 1] == "4"
    assert "--enforce-eager" in command


def test_the_engine_is_told_the_port_of_its_gate_facing_listener():
    from rlbus_inference.admin_access import GATE_PORT_ENV

    env = engine_process.engine_env(initial_version=0, gate_facing_port=9555, mark={})
    assert env[GATE_PORT_ENV] == "9555"


def test_engine_binds_loopback_unless_admin_host_says_otherwise():
    default = engine_process.engine_command(make_config(server={"host": "0.0.0.0"}))
    exposed = engine_process.engine_command(make_config(admin={"host": "10.0.0.5"}))
    assert default[default.index("--host") + 1] == "127.0.0.1"
    assert exposed[exposed.index("--host") + 1] == "10.0.0.5"


def test_vllm_plugins_allowlist_keeps_existing_names_and_adds_ours(monkeypatch):
    monkeypatch.setenv("VLLM_PLUGINS", "other_plugin")
    assert engine_process.vllm_plugins_allowlist().split(",") == ["other_plugin", "rlbus"]


def test_replica_id_is_a_valid_kv_key():
    assert replica.replica_id(make_config(replica_id="host:8000 a")) == "host-8000-a"


def test_replica_info_points_at_the_public_port_and_the_engine():
    config = make_config(
        backend_port=9100,
        server={"port": 9000, "host": "10.0.0.5"},
        vllm={"model": "/m", "served_model_name": "policy"},
    )
    info = replica.make_replica_info(config, version=3, status="ready")
    assert info.base_url == "http://10.0.0.5:9000/v1"
    assert info.admin_url == "http://127.0.0.1:9100"  # admin.host: loopback by default
    exposed = config.model_copy(
        update={"admin": config.admin.model_copy(update={"host": "10.0.0.6"})}
    )
    assert replica.make_replica_info(exposed, version=3, status="ready").admin_url == (
        "http://10.0.0.6:9100"
    )
    assert (info.model, info.weights_version) == ("policy", 3)


def test_every_entry_of_one_replica_process_names_the_same_start():
    """`started_at` tells a restart from an update (the broadcast group, the pool's backoff)."""
    config = make_config()
    first = replica.make_replica_info(config, version=0, status="starting")
    time.sleep(0.01)
    later = replica.make_replica_info(config, version=4, status="ready")
    assert first.started_at == later.started_at == replica.STARTED_AT
    assert later.updated_at > first.updated_at


def test_a_wildcard_bind_registers_an_address_other_hosts_reach(monkeypatch):
    config = make_config(server={"port": 9000, "host": "0.0.0.0"})
    monkeypatch.setattr(replica, "reachable_host", lambda: "node7")
    assert replica.make_replica_info(config, version=0, status="ready").base_url == (
        "http://node7:9000/v1"
    )
    advertised = make_config(server={"port": 9000, "host": "0.0.0.0", "advertise_host": "inf-a"})
    assert replica.make_replica_info(advertised, version=0, status="ready").base_url == (
        "http://inf-a:9000/v1"
    )


def test_reachable_host_is_never_loopback_when_the_host_has_an_address(monkeypatch):
    from rlbus import netutil

    monkeypatch.setattr(netutil.socket, "gethostname", lambda: "vm")
    monkeypatch.setattr(netutil.socket, "gethostbyname", lambda name: "127.0.0.1")
    host = netutil.reachable_host()  # the name maps to loopback: the outward interface instead
    assert host == "vm" or not host.startswith("127.")
    monkeypatch.setattr(netutil.socket, "gethostbyname", lambda name: "10.1.2.3")
    assert netutil.reachable_host() == "vm"


def test_vllm_traces_to_the_collector_rlbus_uses(monkeypatch):
    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    assert engine_process.engine_tracing(make_config()) == (
        [],
        {},
    )  # no collector: vLLM has no file
    grpc = make_config(otel={"endpoint": "http://c:4317", "protocol": "grpc"})
    assert engine_process.engine_tracing(grpc) == (
        ["--otlp-traces-endpoint", "http://c:4317"],
        {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc", "OTEL_SERVICE_NAME": "inference"},
    )
    http = make_config(otel={"endpoint": "http://c:4318", "protocol": "http/protobuf"})
    assert engine_process.engine_tracing(http)[0] == [
        "--otlp-traces-endpoint",
        "http://c:4318/v1/traces",
    ]
    own = make_config(
        otel={"endpoint": "http://c:4318"}, vllm={"model": "/m", "otlp_traces_endpoint": "x"}
    )
    assert engine_process.engine_tracing(own) == ([], {})


def flag_value(command: list[str], flag: str) -> str | None:
    return command[command.index(flag) + 1] if flag in command else None


def test_engine_command_sizes_the_kv_cache_in_bytes_on_cpu(monkeypatch):
    monkeypatch.setattr(engine_process, "on_cpu", lambda: True)
    default = engine_process.engine_command(make_config())
    explicit = engine_process.engine_command(make_config(vllm={"cpu_kv_cache_bytes": "1GiB"}))
    assert flag_value(default, "--kv-cache-memory-bytes") == str(256 * 1024**2)
    assert flag_value(explicit, "--kv-cache-memory-bytes") == str(1024**3)
    assert "--gpu-memory-utilization" not in default


def test_engine_command_sizes_the_kv_cache_by_fraction_on_gpu(monkeypatch):
    monkeypatch.setattr(engine_process, "on_cpu", lambda: False)
    command = engine_process.engine_command(make_config(vllm={"gpu_memory_utilization": 0.8}))
    assert flag_value(command, "--gpu-memory-utilization") == "0.8"
    assert "--kv-cache-memory-bytes" not in command


def test_engine_env_drops_the_legacy_kv_cache_variable(monkeypatch):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "40")
    env = engine_process.engine_env(initial_version=0, gate_facing_port=1, mark={})
    assert "VLLM_CPU_KVCACHE_SPACE" not in env


def test_children_carry_the_launchers_mark_or_a_fresh_one_and_the_engine_core_guard(monkeypatch):
    from rlbus import process_marks
    from rlbus_inference.engine_plugin import GUARD_ENV

    monkeypatch.setenv(process_marks.LAUNCH_ID_ENV, "L1")
    monkeypatch.setenv(process_marks.SERVICE_ENV, "inference-0")
    assert engine_process.replica_mark("r0") == process_marks.mark_env("L1", "inference-0")
    monkeypatch.delenv(process_marks.LAUNCH_ID_ENV)
    fresh = engine_process.replica_mark("r0")
    assert fresh[process_marks.SERVICE_ENV] == "inference-r0"
    assert (
        fresh[process_marks.LAUNCH_ID_ENV]
        != engine_process.replica_mark("r0")[process_marks.LAUNCH_ID_ENV]
    )
    env = engine_process.engine_env(initial_version=0, gate_facing_port=1, mark=fresh)
    assert (
        env[GUARD_ENV] == "1"
        and env[process_marks.LAUNCH_ID_ENV] == fresh[process_marks.LAUNCH_ID_ENV]
    )


def test_the_engine_is_asked_for_fast_start_only_when_configured(monkeypatch):
    from rlbus_inference.engine_plugin import FAST_START_ENV

    monkeypatch.setenv(FAST_START_ENV, "1")  # inherited from a shell: the config decides
    fast = engine_process.engine_env(
        initial_version=0, gate_facing_port=1, mark={}, fast_start=True
    )
    plain = engine_process.engine_env(initial_version=0, gate_facing_port=1, mark={})
    assert fast[FAST_START_ENV] == "1" and FAST_START_ENV not in plain
    assert make_config().fast_start and not make_config(fast_start=False).fast_start


def test_the_engine_platform_is_known_without_importing_torch():
    """vllm-cpu installed: CPU, decided from its package metadata (torch's import is 1.7 s)."""
    script = (
        "import sys; from rlbus_inference import engine_process; "
        "print(engine_process.on_cpu(), 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "False"]


# The lines vLLM-CPU 0.32 logs when it refuses an explicit KV-cache size (from real runs).
OVER_AVAILABLE = (
    "ValueError: Available memory on node 0 (6.01/7.59 GiB) on kv cache allocation is less than "
    "requested memory for kv (102400.0 GiB). Decrease --kv-cache-memory-bytes, "
    "VLLM_CPU_KVCACHE_SPACE, or reduce CPU memory used by other engine_process."
)
UNDER_ONE_SEQUENCE = (
    "ValueError: To serve at least one request with the model's max seq len (2048), (0.0 GiB KV "
    "cache is needed, which is larger than the available KV cache memory (0.0 GiB). Based on the "
    "available memory, the estimated maximum model length is 896. Try increasing "
    "`gpu_memory_utilization` (which also controls CPU memory on the CPU backend) or decreasing "
    "`max_model_len` when initializing the engine."
)
UNDER_ONE_BLOCK = "ValueError: No available memory for the cache blocks. Try increasing ..."


@pytest.mark.parametrize(
    ("engine_log", "expected"),
    [
        (OVER_AVAILABLE, "is more than the 6.01 GiB of memory available"),
        (UNDER_ONE_SEQUENCE, "less than one sequence of max_model_len 2048 (it fits 896 tokens)"),
        (UNDER_ONE_BLOCK, "smaller than one KV-cache block"),
    ],
)
def test_kv_cache_refusals_name_the_field(engine_log, expected):
    size_flag = "--vllm.cpu-kv-cache-bytes 1.0MiB"
    reason = patches.explain_kv_cache_failure(size_flag, "INFO start\n" + engine_log + "\n")
    assert reason is not None and "\n" not in reason
    assert reason.startswith("--vllm.cpu-kv-cache-bytes 1.0MiB ")
    assert expected in reason


def test_other_engine_failures_are_not_blamed_on_the_kv_cache():
    log = "ValueError: head_size 16 is not supported by the CPU attention backend"
    assert patches.explain_kv_cache_failure("--vllm.cpu-kv-cache-bytes 256.0MiB", log) is None


def test_cpu_kv_cache_bytes_accepts_sizes_and_refuses_nonsense():
    assert make_config(vllm={"cpu_kv_cache_bytes": "64MiB"}).vllm.cpu_kv_cache_bytes == 64 << 20
    assert make_config(vllm={"cpu_kv_cache_bytes": 12345}).vllm.cpu_kv_cache_bytes == 12345
    for bad in ("lots", 0):
        with pytest.raises(ValueError, match="cpu_kv_cache_bytes"):
            make_config(vllm={"cpu_kv_cache_bytes": bad})


def test_a_child_that_exits_before_healthy_is_named_with_its_log(tmp_path, free_ports):
    import subprocess
    import sys

    (port,) = free_ports(1)
    log_path = tmp_path / "engine.log"
    child = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    with pytest.raises(engine_process.ChildExited) as exited:
        engine_process.wait_healthy(
            "engine", child, f"http://127.0.0.1:{port}/health", 30, log_path=log_path
        )
    child.wait()
    assert str(exited.value) == (
        f"engine exited with code 3 before becoming healthy; its output is in {log_path}"
    )


def test_an_engine_missing_a_patched_vllm_symbol_ends_the_replica_with_its_own_line(tmp_path):
    """The engine's plugin prints one line and exits PATCH_TARGET_MISSING_EXIT (test_patches.py);
    the replica repeats that line, from the engine's log, as its EngineConfigError."""
    line = (
        f"{patches.PATCH_TARGET_MISSING_PREFIX} (vllm 9.9) has no vllm.x.y (...); rlbus supports z"
    )
    log_path = tmp_path / "engine.log"
    log_path.write_text(f"INFO starting\n{line}\n")
    code = f"raise SystemExit({patches.PATCH_TARGET_MISSING_EXIT})"
    child = subprocess.Popen([sys.executable, "-c", code])
    with pytest.raises(engine_process.EngineConfigError) as refused:
        engine_process.wait_engine_healthy(
            make_config(backend_port=1), child, log_path, threading.Event(), 30.0
        )
    assert str(refused.value) == line.removeprefix("inference: ")
