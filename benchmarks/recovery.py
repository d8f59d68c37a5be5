"""Recovery per process kind: SIGKILL each kind of process of one live `rl` run, time the healing.

    uv run python benchmarks/recovery.py [--kinds engine-core,trainer-rank,...] [--seed N]

One debug run (configs/debug/rl.toml, checkpoint every step, one rollout-worker process) is
started; once it trains, each kind is killed once, in a seeded order, each kill only after the
run trained a step since the previous one (rlbus_launch.chaos). Printed per kind: seconds from the kill
to the next step the trainer finished, that time as a multiple of the run's median step time
measured in the same run, and the steps lost (steps trained again after the kill). Goal (issue
13): 0 lost, recovery under 60 s on CPU.
"""

import argparse
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from rlbus import process_marks
from rlbus_launch import chaos

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kinds", default=",".join(chaos.KINDS))
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--model", default=str(REPO / "examples" / "reverse-text" / "model"))
    args = parser.parse_args()
    kinds = tuple(k for k in args.kinds.split(",") if k)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
    max_steps = 3 * len(kinds) + 8
    out = Path(tempfile.mkdtemp(prefix="rlbus-recovery-"))
    argv = [
        str(BIN / "rl"), "@", str(REPO / "configs" / "debug" / "rl.toml"),
        "--output-dir", str(out), "--run.name", "recovery", "--model.name", args.model,
        "--max-steps", str(max_steps), "--ckpt.interval", "1", "--ckpt.keep-last", "2",
        "--supervision.max-restarts", "50", "--deployment.num-rollout-workers", "1",
    ]  # fmt: skip
    run_dir = out / "recovery"
    console = open(out / "console.txt", "wb")
    launcher = subprocess.Popen(argv, cwd=REPO, stdout=console, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip
    launch_id = None
    try:
        launch_id = chaos.wait_for_launch_id(run_dir, timeout_s=300)
        monkey = chaos.ChaosMonkey(launcher.pid, run_dir, num_kills=len(kinds), seed=seed,
                                   kinds=kinds, stop_at_step=max_steps - 2)  # fmt: skip
        kills = monkey.run()
        code = launcher.wait(1800)
    finally:
        if launcher.poll() is None:
            launcher.kill()
        if launch_id:
            process_marks.terminate(process_marks.marked_pids(launch_id), grace_s=5)
    rows = chaos.recovery(kills, run_dir)
    times = [at for _, at in chaos.trained_steps(run_dir)]
    kill_times = [kill.at for kill in kills]
    quiet = [
        b - a
        for a, b in zip(times, times[1:], strict=False)
        if not any(a < k <= b for k in kill_times)
    ]
    step_s = statistics.median(quiet) if quiet else float("nan")
    print(f"recovery benchmark, seed {seed}, rl exit code {code}, run dir {run_dir}")
    print(f"median step time without a kill: {step_s:.2f} s ({len(quiet)} steps)")
    print(f"{'kind':<18} {'recovery_s':>10} {'x step':>7} {'steps_lost':>10}")
    for row in rows:
        rec = row["recovery_s"]
        rec_text = f"{rec:10.1f}" if rec is not None else f"{'-':>10}"
        ratio = f"{rec / step_s:7.1f}" if rec is not None and step_s == step_s else f"{'-':>7}"
        print(f"{row['kind']:<18} {rec_text} {ratio} {row['steps_lost']:>10}")
    return 0 if code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
