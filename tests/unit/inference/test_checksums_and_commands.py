"""Unit tests of the inference service's pure parts: child commands, registry entries."""

from rlbus.configs.inference import InferenceConfig
from rlbus_inference import processes, replica


def make_config(**overrides) -> InferenceConfig:
    return InferenceConfig(**overrides)


def test_engine_command_passes_vllm_options_and_worker_extension():
    config = make_config(
        backend_port=9100,
        vllm={"model": "/m", "max_model_len": 128, "enforce_eager": True, "max_num_seqs": 4},
    )
    command = processes.engine_command(config)
    assert command[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert command[command.index("--port") + 1] == "9100"
    assert command[command.index("--worker-extension-cls") + 1] == processes.WORKER_EXTENSION
    assert command[command.index("--model") + 1] == "/m"
    assert command[command.index("--max-num-seqs") + 1] == "4"
    assert "--enforce-eager" in command


def test_router_forwards_to_the_router_facing_listener_not_the_admin_port():
    config = make_config(backend_port=9100, server={"port": 9000, "host": "127.0.0.1"})
    command = processes.router_command(config, router_facing_port=9555)
    assert command[command.index("--worker-urls") + 1] == "http://127.0.0.1:9555"
    assert command[command.index("--port") + 1] == "9000"


def test_vllm_plugins_allowlist_keeps_existing_names_and_adds_ours(monkeypatch):
    monkeypatch.setenv("VLLM_PLUGINS", "other_plugin")
    assert processes.vllm_plugins_allowlist().split(",") == ["other_plugin", "rlbus"]


def test_replica_id_is_a_valid_kv_key():
    assert replica.replica_id(make_config(replica_id="host:8000 a")) == "host-8000-a"


def test_replica_info_points_at_router_and_engine():
    config = make_config(
        backend_port=9100,
        server={"port": 9000, "host": "10.0.0.5"},
        vllm={"model": "/m", "served_model_name": "policy"},
    )
    info = replica.make_replica_info(config, version=3, status="ready")
    assert info.base_url == "http://10.0.0.5:9000/v1"
    assert info.admin_url == "http://10.0.0.5:9100"
    assert (info.model, info.weights_version) == ("policy", 3)


def test_engine_command_lowers_unset_memory_fraction_on_cpu(monkeypatch):
    monkeypatch.setattr(processes, "on_cpu", lambda: True)
    unset = processes.engine_command(make_config())
    explicit = processes.engine_command(make_config(vllm={"gpu_memory_utilization": 0.05}))
    assert unset[unset.index("--gpu-memory-utilization") + 1] == "0.3"
    assert explicit[explicit.index("--gpu-memory-utilization") + 1] == "0.05"
