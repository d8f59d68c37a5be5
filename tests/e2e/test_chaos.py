"""Chaos: one `rl` debug run, 20+ SIGKILLs at random moments over every process kind; it heals.

The seed is printed (and can be fixed with RLBUS_CHAOS_SEED) so a failure can be replayed. vLLM's
processes cost a minute or more to come back on 2 cores, so each vLLM kind is killed once per
round and the cheap kinds (coordinator, rollout worker, trainer, nats-server, monitor) several
times: every kind is hit, the whole test stays inside the CI budget. The debug run's one trainer
rank runs without torchrun (docs/launcher.md), so there is no agent to kill: a SIGKILLed agent is
tests/integration/trainer/test_trainer_service.py's.
"""

import os
import random
import threading

import pytest
from e2e_support import RlLaunch, log_events, metrics_lines

from rlbus import process_marks
from rlbus_launch import chaos

pytestmark = pytest.mark.slow

CHEAP = (
    "coordinator",
    "rollout-worker",
    "trainer-rank",
    "nats-server",
    "monitor",
)
VLLM = ("engine-core", "api-server", "inference-leader")
KILLS = 22
MAX_STEPS = 4 * KILLS + 8
"""A kill waits for a step after the one before plus up to MAX_DELAY_S: at ~0.5 s per step (the
fast vLLM start and 256 samples in flight) one kill can take 4 steps, and the run must outlast
all 22 (it once finished first, at 2 * KILLS + 8 with ~1 s steps)."""
MAX_DELAY_S = 1.0


def test_twenty_sigkills_over_every_process_kind_and_the_run_heals(tmp_path, starting_model):
    seed = int(os.environ.get("RLBUS_CHAOS_SEED") or random.SystemRandom().randrange(2**31))
    print(f"chaos seed {seed} (replay: RLBUS_CHAOS_SEED={seed})")
    run = RlLaunch(
        tmp_path, "chaos",
        "--model.name", str(starting_model.path),
        "--max-steps", str(MAX_STEPS),
        "--ckpt.interval", "1",
        "--ckpt.keep-last", "2",
        "--supervision.max-restarts", "50",
        "--deployment.num-rollout-workers", "1",
    )  # fmt: skip
    monkey = chaos.ChaosMonkey(
        run.popen.pid,
        run.run_dir,
        num_kills=KILLS,
        seed=seed,
        kinds=CHEAP * 3 + VLLM,
        max_delay_s=MAX_DELAY_S,
        stop_at_step=MAX_STEPS - 3,
    )
    killer = threading.Thread(target=monkey.run, daemon=True)
    launch_id = None
    try:
        launch_id = chaos.wait_for_launch_id(run.run_dir, timeout_s=120)
        killer.start()
        code = run.wait(timeout_s=1800)
        killer.join(60)
        assert code == 0, f"seed {seed}: rl exited {code}\n{run.output()[-5000:]}"
    finally:
        run.kill()
        if launch_id:
            process_marks.terminate(process_marks.marked_pids(launch_id), grace_s=2)
    kinds_hit = {kill.kind for kill in monkey.kills}
    expected = set(CHEAP + VLLM)
    assert len(monkey.kills) >= 20, f"seed {seed}: only {len(monkey.kills)} kills happened"
    assert kinds_hit == expected, f"seed {seed}: never killed {expected - kinds_hit}"

    # Steps consecutive, none trained twice: every step finished once, in order.
    trained = [step for step, _ in chaos.trained_steps(run.run_dir)]
    assert trained == sorted(set(trained)), f"seed {seed}: a step was trained twice: {trained}"
    all_rows = metrics_lines(run.run_dir)
    rows = [row for row in all_rows if "loss" in row]
    missing = sorted(set(range(1, MAX_STEPS + 1)) - {row["step"] for row in rows})
    assert [row["step"] for row in rows] == list(range(1, MAX_STEPS + 1)), (
        f"seed {seed}: steps without a trainer row {missing}; their rows: "
        f"{[row for row in all_rows if row['step'] in missing]}; kills: {monkey.kills}"
    )
    assert not any(row.get("retrained") for row in rows), f"seed {seed}: retrained steps"
    # Every issued task trained, dropped with a counted reason, or still outstanding.
    last = rows[-1]
    dropped = sum(v for k, v in last.items() if k.startswith("tasks/dropped/"))
    assert last["tasks/issued"] == last["tasks/trained"] + dropped + last["tasks/outstanding"], (
        f"seed {seed}: tasks unaccounted: { ({k: v for k, v in last.items() if k.startswith('tasks/')}) }"
    )
    # Weights versions never went backwards (and none was published twice).
    versions = chaos.published_versions(run.run_dir)
    assert versions == sorted(set(versions)) and versions[-1] == MAX_STEPS, f"seed {seed}"
    # The launcher said what died, why, and that it came back (the monitor is its own child).
    monitor_kills = {kill.pid for kill in monkey.kills if kill.kind == "monitor"}
    died = {e["pid"]: e for e in log_events(run.run_dir, "service_died")}
    died_how = {pid: died.get(pid, {}).get("signal") for pid in monitor_kills}
    assert set(died_how.values()) <= {"SIGKILL"}, (
        f"seed {seed}: service_died of monitors: {died_how}"
    )
    restarted = log_events(run.run_dir, "service_restarted")
    assert sum(e["service"] == "monitor" for e in restarted) >= len(monitor_kills), f"seed {seed}"
    output = run.output()
    assert "monitor died (killed by SIGKILL); restarting in" in output, f"seed {seed}"
    assert "monitor is back (pid " in output, f"seed {seed}"
    # No process of the run survives it.
    assert process_marks.marked_pids(launch_id) == [], f"seed {seed}: survivors"
    for row in chaos.recovery(monkey.kills, run.run_dir):
        print(row)
