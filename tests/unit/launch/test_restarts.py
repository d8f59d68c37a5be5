"""Restart policy of the `rl` launcher: budget over a sliding window, doubling backoff, codes that
are never restarted."""

import signal

from rlbus.configs import RLConfig
from rlbus.configs.base import parse_cli
from rlbus.configs.common import SupervisionConfig
from rlbus_launch.restarts import (
    GiveUp,
    Restart,
    RestartPolicy,
    describe_exit,
    launcher_exit_code,
    shell_exit_code,
)


def policy(**fields) -> RestartPolicy:
    return RestartPolicy(SupervisionConfig(**fields))


def test_backoff_doubles_then_caps():
    p = policy(max_restarts=10, window_s=1000, backoff_s=1, max_backoff_s=5)
    delays = [p.decide("trainer", 1, now=float(t)).delay_s for t in range(6)]
    assert delays == [1, 2, 4, 5, 5, 5]


def test_budget_is_spent_within_the_window_and_names_the_setting():
    p = policy(max_restarts=2, window_s=600)
    first, second = p.decide("orchestrator", -9, now=0.0), p.decide("orchestrator", 1, now=10.0)
    assert isinstance(first, Restart) and (first.number, first.budget) == (1, 2)
    assert isinstance(second, Restart) and second.number == 2
    third = p.decide("orchestrator", -9, now=20.0)
    assert isinstance(third, GiveUp)
    assert third.reason == (
        "orchestrator restarted 2 times in 600 s (supervision.max_restarts); giving up"
    )


def test_the_window_slides_and_backoff_restarts_with_it():
    p = policy(max_restarts=2, window_s=100, backoff_s=1)
    assert p.decide("monitor", 1, now=0.0).delay_s == 1
    assert p.decide("monitor", 1, now=50.0).delay_s == 2
    # the restart at t=0 left the window at t=100: one slot free again, backoff as after one
    again = p.decide("monitor", 1, now=100.0)
    assert isinstance(again, Restart) and again.delay_s == 2 and again.number == 2
    assert isinstance(p.decide("monitor", 1, now=120.0), GiveUp)
    # budgets are per service
    assert isinstance(p.decide("nats", 1, now=120.0), Restart)


def test_config_errors_and_missing_services_are_never_restarted():
    p = policy(max_restarts=100)
    for code, why in ((2, "a config error"), (3, "not installed")):
        decision = p.decide("inference", code, now=0.0)
        assert isinstance(decision, GiveUp) and why in decision.reason
        assert f"exited with code {code}" in decision.reason
    assert not p.restarts.get("inference")  # nothing counted against the budget


def test_supervision_off_gives_up_at_the_first_death():
    decision = policy(enabled=False).decide("trainer", -int(signal.SIGKILL), now=0.0)
    assert isinstance(decision, GiveUp)
    assert decision.reason == "trainer killed by SIGKILL; supervision is off, stopping the run"


def test_exits_are_described_and_signals_become_128_plus_n():
    assert describe_exit(-9) == "killed by SIGKILL"
    assert describe_exit(-15) == "killed by SIGTERM"
    assert describe_exit(1) == "exited with code 1"
    assert launcher_exit_code(-9) == 137
    assert launcher_exit_code(0) == 1
    assert launcher_exit_code(247) == 247
    assert shell_exit_code(-9) == 137 and shell_exit_code(0) == 0 and shell_exit_code(2) == 2


def test_a_sigkilled_child_exit_code_is_137_not_247(tmp_path):
    """`sys.exit(-9)` (a Popen return code passed on as is) exits 247; shell_exit_code gives 137."""
    import subprocess
    import sys

    child = subprocess.run([sys.executable, "-c", "import os; os.kill(os.getpid(), 9)"])
    assert child.returncode == -9
    passed_on = subprocess.run([sys.executable, "-c", "import sys; sys.exit(-9)"])
    assert passed_on.returncode == 247
    assert shell_exit_code(child.returncode) == 137


def test_supervision_flags_parse_like_every_other_field():
    config = parse_cli(
        RLConfig,
        ["--supervision.max-restarts", "3", "--supervision.window-s", "60",
         "--supervision.backoff-s", "0.5", "--no-supervision.enabled"],
        prog="rl",
    )  # fmt: skip
    assert config.supervision == SupervisionConfig(
        enabled=False, max_restarts=3, window_s=60, backoff_s=0.5
    )
    assert RLConfig().supervision.max_restarts == 5


def test_a_torchrun_job_whose_rank_cannot_resume_is_not_restarted():
    """torchrun's agent exits 1 whatever its ranks did; its failure summary names the rank's
    code, and a 2 (config error, checkpoint gone) must stop the run instead of being retried."""
    from rlbus_launch.restarts import GiveUp, RestartPolicy, rank_exit_code

    torchrun = ["python", "-m", "torch.distributed.run", "-m", "rlbus_trainer.entrypoint"]
    summary = (
        "Failures:\n  <NO_OTHER_FAILURES>\nRoot Cause:\n  rank      : 0\n  exitcode  : 2 (pid: 7)\n"
    )
    assert rank_exit_code(1, torchrun, summary) == 2
    assert rank_exit_code(1, torchrun, summary.replace(": 2 (", ": 1 (")) == 1
    assert rank_exit_code(1, ["python", "-m", "x"], summary) == 1  # not torchrun: as is
    assert rank_exit_code(-9, torchrun, summary) == -9
    assert isinstance(RestartPolicy().decide("trainer", 2, now=0.0), GiveUp)
