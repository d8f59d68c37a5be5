"""`rl --inference.attach`: the plan starts the attach process in the inference replica's place
(no vLLM argv, no ports picked, no CPU binding; one per server, at the ports + i), the flag's
spellings, the refusals; and `inference @ rl.toml` serves what the rl config's replica would."""

from pathlib import Path

import httpx
import pytest

from rlbus.configs import InferenceConfig, RLConfig
from rlbus.configs.base import parse_cli
from rlbus_launch.plan import build_rl_launch
from rlbus_launch.rl import main as rl_main

ROOT = Path(__file__).resolve().parents[3]
DEBUG_RL = str(ROOT / "configs" / "debug" / "rl.toml")
EXAMPLE_RL = str(ROOT / "examples" / "reverse-text" / "rl.toml")


@pytest.mark.parametrize(
    ("args", "url"),
    [
        (["--inference.attach"], "http://127.0.0.1:8000"),
        (["--inference.attach", "http://gpu-3:9000/"], "http://gpu-3:9000"),
        (["--inference.attach.url", "http://gpu-3:9000"], "http://gpu-3:9000"),
        (["--inference.attach", "--max-steps", "3"], "http://127.0.0.1:8000"),
    ],
)
def test_attach_spellings(args, url):
    from rlbus.configs.inference import attach_url_flags

    config = parse_cli(RLConfig, attach_url_flags(["@", DEBUG_RL, *args], "--inference.attach"))
    assert config.inference.attach.url == url
    host = url.rsplit(":", 1)[0]
    assert config.inference.attach.admin_url == f"{host}:8100"  # the server's default admin port


def test_an_attach_url_and_an_admin_url_side_by_side_both_count():
    """The loader alone would let `--inference.attach URL` drop the admin URL silently."""
    from rlbus.configs.inference import attach_url_flags

    for args in (
        ["--inference.attach", "http://h:1", "--inference.attach.admin-url", "http://h:2"],
        ["--inference.attach.admin-url", "http://h:2", "--inference.attach", "http://h:1"],
    ):
        flags = attach_url_flags(["@", DEBUG_RL, *args], "--inference.attach")
        attach = parse_cli(RLConfig, flags).inference.attach
        assert (attach.url, attach.admin_url) == ("http://h:1", "http://h:2")
    bare = attach_url_flags(["--inference.attach", "--max-steps", "3"], "--inference.attach")
    assert bare[0] == "--inference.attach"


@pytest.mark.parametrize(
    ("line", "url"),
    [("attach = true", "http://127.0.0.1:8000"), ('attach = "http://h:5"', "http://h:5")],
)
def test_attach_in_a_toml_file(tmp_path, line, url):
    file = tmp_path / "attach.toml"
    file.write_text(f"[inference]\n{line}\n")
    attach = parse_cli(RLConfig, ["@", DEBUG_RL, "@", str(file)]).inference.attach
    assert attach.url == url


def test_no_attach_by_default_and_no_flag_turns_it_off():
    assert parse_cli(RLConfig, ["@", DEBUG_RL]).inference.attach is None
    off = parse_cli(RLConfig, ["@", DEBUG_RL, "--inference.attach", "--no-inference.attach"])
    assert off.inference.attach is None


def test_an_attach_url_that_is_not_http_is_one_config_error(capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_cli(RLConfig, ["@", DEBUG_RL, "--inference.attach", "gpu-3:9000"])
    assert exit_.value.code == 2
    assert "--inference.attach" in capsys.readouterr().err


def test_the_plan_starts_the_attach_process_instead_of_vllm(tmp_path):
    config = parse_cli(RLConfig, ["@", DEBUG_RL, "--inference.attach"]).with_run_name("r")
    launch = build_rl_launch(config, tmp_path)
    names = [p.name for p in launch.processes]
    assert names == ["nats", "monitor", "inference", "orchestrator", "trainer"]
    inference = next(p for p in launch.processes if p.name == "inference")
    assert inference.argv[1:3] == ["-m", "rlbus_inference.entrypoint"]
    assert inference.env == {} and "taskset" not in inference.argv[0]
    resolved = launch.configs["inference"]
    assert resolved.attach.url == "http://127.0.0.1:8000"
    # no ports picked: the attach process binds none; the URLs are the attached server's
    assert (resolved.server.port, resolved.backend_port) == (8000, 8100)
    assert resolved.bus.url == launch.configs["trainer"].bus.url is not None


def test_several_attached_servers_are_found_at_the_ports_plus_i(tmp_path):
    args = ["@", DEBUG_RL, "--inference.attach", "--deployment.num-infer-replicas", "2"]
    launch = build_rl_launch(parse_cli(RLConfig, args).with_run_name("r"), tmp_path)
    names = [p.name for p in launch.processes]
    assert names == ["nats", "monitor", "inference-0", "inference-1", "orchestrator", "trainer"]
    urls = [(c.attach.url, c.attach.admin_url) for n, c in launch.configs.items() if "-" in n]
    assert urls == [
        ("http://127.0.0.1:8000", "http://127.0.0.1:8100"),
        ("http://127.0.0.1:8001", "http://127.0.0.1:8101"),
    ]
    assert [launch.configs[f"inference-{i}"].replica_id for i in range(2)] == ["0", "1"]


def test_several_attached_servers_need_urls_with_ports(capsys):
    with pytest.raises(SystemExit) as exit_:
        rl_main(
            [
                "@",
                DEBUG_RL,
                "--inference.attach",
                "http://gpu-3",
                "--deployment.num-infer-replicas",
                "2",
            ]
        )
    assert exit_.value.code == 2
    words = " ".join(capsys.readouterr().err.replace("│", " ").split())  # the box wraps lines
    assert "http://gpu-3 names no port" in words


def test_inference_at_an_rl_config_serves_its_replica_without_attach(tmp_path):
    from rlbus_inference.entrypoint import parse_args

    rl = parse_cli(RLConfig, ["@", EXAMPLE_RL])
    attaching = tmp_path / "rl.toml"
    attaching.write_text(
        Path(EXAMPLE_RL).read_text() + '\n[inference.attach]\nurl = "http://x:1"\n'
    )
    served = parse_args(["@", str(attaching)])
    assert served.vllm == rl.inference.vllm  # model, dtype, max_model_len pushed down
    assert served.vllm.max_model_len == 128 and served.vllm.dtype == "float32"
    assert served.attach is None and served.bus.url is None and served.run_dir is None
    flagged = parse_args(["@", EXAMPLE_RL, "--server.port", "9001"])
    assert flagged.server.port == 9001


def test_a_plain_inference_file_still_parses_as_before(tmp_path):
    from rlbus_inference.entrypoint import parse_args

    file = tmp_path / "inference.toml"
    file.write_text('backend_port = 8200\n[vllm]\nmodel = "m"\n')
    assert parse_args(["@", str(file)]).backend_port == 8200


def attached_config(**attach) -> InferenceConfig:
    return InferenceConfig(
        vllm={"model": str(ROOT / "examples" / "reverse-text" / "model")},
        attach={"url": "http://srv:8000", "admin_url": "http://srv:8100", **attach},
    )


@pytest.mark.parametrize(
    ("status", "code", "words"),
    [
        (422, 2, "whose tensors differ from the run's model"),
        (400, 2, "refused the run's model directory"),
        (500, 4, "500"),
    ],
)
def test_a_refused_reset_is_one_line_with_its_exit_code(status, code, words):
    """The code around the engine's answer to the reset (a real engine answers the same
    statuses: tests/integration/inference/test_inference_service.py)."""
    from rlbus_inference import attached

    def answer(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/update_weights"
        return httpx.Response(status, json={"error": "tensor x: shape [2] but [3]"})

    with httpx.Client(transport=httpx.MockTransport(answer)) as admin:
        with pytest.raises(attached.AttachFailed) as failed:
            attached.reset_weights(admin, attached_config(), served="other")
    assert failed.value.code == code
    assert words in str(failed.value) and "\n" not in str(failed.value)
