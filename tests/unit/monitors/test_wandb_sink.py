"""The wandb sink with the real wandb package, offline in a temp dir (no network, no login), and
the config that turns it on."""

import importlib.util
import sys

import pytest
from wandb_support import offline_runs, use_offline_wandb

from rlbus.configs import RLConfig
from rlbus.configs.base import parse_cli
from rlbus.configs.common import MonitorsConfig, WandbMonitorConfig
from rlbus.obs.sinks import WandbSink, check_sinks_installed, wandb_mode, wandb_run_id
from rlbus.rundirs import rollouts_file
from rlbus.samples import sample_record, write_records
from rlbus.wire.events import StepMetrics
from rlbus.wire.rollouts import Rollout, RolloutSample
from rlbus.wire.tasks import ChatMessage
from rlbus.wire.weights import WeightsApplied
from rlbus_launch.monitor.join import StepJoiner


@pytest.fixture
def offline_wandb(monkeypatch, tmp_path):
    use_offline_wandb(monkeypatch, tmp_path)
    monkeypatch.setenv("WANDB_CONSOLE", "off")  # in-process: leave pytest's stdout alone
    yield
    import wandb

    wandb.teardown()  # stop this process's wandb-core service


def make_metrics(service, step, **metrics):
    return StepMetrics(service=service, step=step, metrics=metrics, time=float(step))


def make_sink(run_dir, **fields) -> WandbSink:
    config = WandbMonitorConfig(offline=True, **fields)
    return WandbSink(config, "run-7", run_dir, {"seq_len": 128, "model": {"name": "tiny"}})


@pytest.mark.timeout(60)
def test_offline_sink_logs_each_service_under_its_name_at_the_training_step(
    tmp_path, offline_wandb
):
    joiner = StepJoiner()
    sink = make_sink(tmp_path, project="proj", group="sweep-1", tags=["a", "b"])
    joiner.add_weights(WeightsApplied(version=1, replica_id="r0", duration_s=0.25))
    for step in (1, 2, 3):
        orchestrator = make_metrics(
            "orchestrator", step, **{"reward/mean": step / 10, "tokens_per_s": 100.0 * step}
        )
        trainer = make_metrics("trainer", step, loss=1.0 / step, tokens_per_s=7.0)
        # step 2: the trainer reports first, so the row's bare `tokens_per_s` is the trainer's
        first, second = (trainer, orchestrator) if step == 2 else (orchestrator, trainer)
        joiner.add_metrics(first)
        for row, _ in joiner.add_metrics(second):
            sink.write(row)
    sink.close()

    (run,) = offline_runs(tmp_path)
    assert run.path.parent.parent == tmp_path / "wandb"
    assert run.exit_code == 0  # finish() completed the offline run
    assert run.run["display_name"] == "run-7"  # no name: the run id
    assert run.run["project"] == "proj" and run.run["run_group"] == "sweep-1"
    assert run.run["tags"] == ["a", "b"]
    assert run.config["seq_len"] == 128 and run.config["model"] == {"name": "tiny"}
    weights = {"weights/num_applied": 1, "weights/applied/r0": 1, "weights/apply_s": 0.25}
    assert run.history == {
        step: {
            "orchestrator/reward/mean": step / 10,
            "orchestrator/tokens_per_s": 100.0 * step,
            "trainer/loss": 1.0 / step,
            "trainer/tokens_per_s": 7.0,
            **(weights if step == 1 else {}),  # the monitor's own keys keep their names
        }
        for step in (1, 2, 3)
    }  # no `time`: wandb has its own timestamps


@pytest.mark.timeout(60)
def test_sink_reopened_on_the_same_run_dir_continues_the_same_wandb_run(tmp_path, offline_wandb):
    first = make_sink(tmp_path, name="shown")
    first.write({"step": 1, "loss": 1.0, "note": "text is not logged"})
    first.close()
    second = make_sink(tmp_path, name="shown")  # a restarted monitor, or `rl --resume`
    second.write({"step": 2, "loss": 0.5})
    second.close()

    runs = offline_runs(tmp_path)
    assert [r.history for r in runs] == [{1: {"loss": 1.0}}, {2: {"loss": 0.5}}]
    assert runs[0].run["run_id"] == runs[1].run["run_id"]
    assert runs[0].run["display_name"] == "shown"


@pytest.mark.timeout(60)
def test_wandb_mode_from_the_environment_wins_over_offline(tmp_path, offline_wandb, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    sink = make_sink(tmp_path)
    sink.write({"step": 1, "loss": 1.0})
    sink.close()

    assert offline_runs(tmp_path) == []
    assert wandb_mode(WandbMonitorConfig(offline=True)) is None
    monkeypatch.delenv("WANDB_MODE")
    assert wandb_mode(WandbMonitorConfig(offline=True)) == "offline"
    assert wandb_mode(WandbMonitorConfig()) == "online"


def test_wandb_run_id_is_made_once_per_run_dir_without_reserved_characters(tmp_path):
    run_id = wandb_run_id(tmp_path / "a", "exp:1/x")

    assert run_id.startswith("exp-1-x-")
    assert wandb_run_id(tmp_path / "a", "exp:1/x") == run_id
    assert wandb_run_id(tmp_path / "b", "exp:1/x") != run_id  # e.g. after `--clean`


def flat(text: str) -> str:
    """A rich error box flattened for substring checks."""
    for char in "│╭╮╰╯─":
        text = text.replace(char, " ")
    return " ".join(text.split())


def test_missing_wandb_is_a_config_error_that_names_uv_sync_group(monkeypatch, capsys):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "wandb" else find_spec(name, *a),
    )
    with pytest.raises(SystemExit) as exit:
        check_sinks_installed(MonitorsConfig(wandb=WandbMonitorConfig()))

    message = flat(capsys.readouterr().err)
    assert exit.value.code == 2
    assert "`uv sync --group wandb`" in message and "--monitors.wandb" in message
    assert "pip install" not in message


def test_wandb_sink_without_the_package_names_uv_sync_group(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    with pytest.raises(RuntimeError, match="uv sync --group wandb"):
        make_sink(tmp_path)


def test_wandb_is_enabled_by_bare_flag_monitors_table_and_legacy_table(tmp_path):
    fields = 'project = "p"\nname = "n"\nentity = "e"\ngroup = "g"\ntags = ["t"]\noffline = true\n'
    (tmp_path / "new.toml").write_text("[monitors.wandb]\n" + fields)
    (tmp_path / "old.toml").write_text("[wandb]\n" + fields)
    expected = WandbMonitorConfig(
        project="p", name="n", entity="e", group="g", tags=["t"], offline=True
    )

    assert parse_cli(RLConfig, ["--monitors.wandb"]).monitors.wandb == WandbMonitorConfig()
    assert parse_cli(RLConfig, ["--wandb"]).monitors.wandb == WandbMonitorConfig()
    assert parse_cli(RLConfig, ["@", str(tmp_path / "new.toml")]).monitors.wandb == expected
    assert parse_cli(RLConfig, ["@", str(tmp_path / "old.toml")]).monitors.wandb == expected
    assert parse_cli(RLConfig, []).monitors.wandb is None


def test_online_wandb_without_a_login_is_refused_before_the_run_starts(
    monkeypatch, tmp_path, capsys
):
    for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    netrc = tmp_path / "netrc"
    monkeypatch.setenv("NETRC", str(netrc))  # none yet: not logged in
    with pytest.raises(SystemExit) as exit:
        check_sinks_installed(MonitorsConfig(wandb=WandbMonitorConfig()))
    assert exit.value.code == 2
    message = flat(capsys.readouterr().err)
    assert "`wandb login`" in message and "--monitors.wandb.offline" in message

    check_sinks_installed(MonitorsConfig(wandb=WandbMonitorConfig(offline=True)))  # no login needed
    monkeypatch.setenv("WANDB_MODE", "offline")
    check_sinks_installed(MonitorsConfig(wandb=WandbMonitorConfig()))  # the environment wins
    monkeypatch.delenv("WANDB_MODE")
    netrc.write_text("machine api.wandb.ai\n  login user\n  password k\n")
    netrc.chmod(0o600)
    check_sinks_installed(MonitorsConfig(wandb=WandbMonitorConfig()))  # what `wandb login` writes


@pytest.mark.timeout(60)
def test_eval_rows_have_their_own_axis_and_kept_samples_log_as_a_table(tmp_path, offline_wandb):
    rollout = Rollout(
        task_id="train-4",
        step=2,
        env_id="reverse-text",
        prompt=[ChatMessage(role="user", content="reverse: abc")],
        samples=[
            RolloutSample(
                prompt_token_ids=[1],
                completion_token_ids=[2],
                completion_logprobs=[-0.5],
                completion_mask=[1],
                reward=0.75,
                completion_text="cba",
            )
        ],
    )
    write_records(rollouts_file(tmp_path, 2), [sample_record(rollout, 0, step=2, advantage=0.25)])
    sink = make_sink(tmp_path)
    sink.write({"step": 1, "loss": 1.0})
    sink.write({"step": 2, "loss": 0.5})
    sink.write_eval({"step": 0, "env": "rt", "eval/rt/reward/mean": 0.5, "time": 1.0})
    sink.close()

    (run,) = offline_runs(tmp_path)
    assert run.history[1] == {"loss": 1.0}
    assert run.history[2]["loss"] == 0.5
    assert run.history[2]["samples._type"] == "table-file"  # the step's kept samples
    assert (run.history[2]["samples.nrows"], run.history[2]["samples.ncols"]) == (1, 7)
    assert run.history[2]["eval/rt/reward/mean"] == 0.5 and run.history[2]["eval/step"] == 0
