"""Fault injection for a live run: find its processes by kind and SIGKILL them on a seeded schedule.

    python -m rlbus_launch.chaos <launcher pid> <run_dir> --kills 20 --seed 7

Used by the chaos test (tests/e2e/test_chaos.py) and benchmarks/recovery.py, and by anyone who
wants to see a deployment heal before trusting it with a week of GPU time. Processes are found as
the live descendants of the `rl` launcher (through `/proc`, whatever their session or group) and
told apart by their command line (`kind_of`). Kills are spread over the kinds in a shuffled
round-robin, each one only after the run trained a step since the previous kill (so every kill
hits a run that is healthy again, not one still recovering), after a random delay.

What the run logged is read back from its run directory: the trainer's `train_step` and
`weights_published` events (logs/trainer.log, JSON lines with timestamps) give the steps trained
and the weights versions published, in order, across restarts.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from rlbus import process_marks
from rlbus_launch.lock import LOCK_FILE

KINDS = (
    "coordinator",
    "rollout-worker",
    "trainer-rank",
    "torchrun-agent",
    "engine-core",
    "api-server",
    "inference-leader",
    "nats-server",
    "monitor",
)
"""Every process kind of an RL run, as `kind_of` names them."""


def kind_of(cmdline: str) -> str | None:
    """The kind of a run's process from its command line (None: not one of ours, e.g. a shell)."""
    if cmdline.startswith("VLLM::EngineCore"):
        return "engine-core"
    if cmdline.startswith("VLLM::"):
        return None  # vLLM's own workers: they go with the engine core
    if "vllm.entrypoints" in cmdline:
        return "api-server"
    if "rlbus_inference.entrypoint" in cmdline:
        return "inference-leader"
    if "torch.distributed.run" in cmdline:
        return "torchrun-agent"
    if "rlbus_trainer.entrypoint" in cmdline:
        return "trainer-rank"
    if "rlbus_orchestrator.entrypoint" in cmdline:
        return "rollout-worker" if "--role worker" in cmdline else "coordinator"
    if "rlbus_launch.monitor" in cmdline:
        return "monitor"
    if cmdline.split(" ", 1)[0].endswith("nats-server"):
        return "nats-server"
    return None


def cmdline_of(pid: int) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return ""
    return " ".join(part.decode(errors="replace") for part in raw.split(b"\0") if part)


def descendants(root: int) -> list[int]:
    """Live descendants of `root` (children, their children, ...), from /proc's parent links."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rpartition(")")[2].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if process_marks.alive(child):
                found.append(child)
            todo.append(child)
    return sorted(found)


def processes_by_kind(launcher_pid: int) -> dict[str, list[int]]:
    """kind -> live pids, among the launcher's descendants."""
    by_kind: dict[str, list[int]] = {}
    for pid in descendants(launcher_pid):
        kind = kind_of(cmdline_of(pid))
        if kind is not None:
            by_kind.setdefault(kind, []).append(pid)
    return by_kind


def wait_for_launch_id(run_dir: Path, timeout_s: float = 120.0) -> str:
    """The launch id of the `rl` running in `run_dir` (from its launcher.json), once it is there."""
    path = run_dir / LOCK_FILE
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            return json.loads(path.read_text())["launch_id"]
        except (OSError, ValueError, KeyError):
            time.sleep(0.2)
    raise TimeoutError(f"no {path} with a launch_id after {timeout_s:.0f} s")


@dataclass
class Kill:
    kind: str
    pid: int
    at: float
    """time.time() of the SIGKILL."""
    step_before: int
    """Newest trained step when it was killed."""


def _timestamp(event: dict) -> float:
    return datetime.fromisoformat(event["timestamp"].replace("Z", "+00:00")).timestamp()


def trainer_events(run_dir: Path, name: str) -> list[dict]:
    """Rank 0's `name` events (e.g. train_step, weights_published) from logs/trainer.log, in order."""
    path = run_dir / "logs" / "trainer.log"
    if not path.exists():
        return []
    found = []
    for line in path.read_text(errors="replace").splitlines():
        if not line.startswith("{") or f'"{name}"' not in line:
            continue
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue
        if event.get("event") == name and event.get("rank", 0) == 0:
            event["time"] = _timestamp(event)
            found.append(event)
    return found


def trained_steps(run_dir: Path) -> list[tuple[int, float]]:
    """(step, time) of every step the trainer finished, in log order, across restarts."""
    return [(event["step"], event["time"]) for event in trainer_events(run_dir, "train_step")]


def published_versions(run_dir: Path) -> list[int]:
    """Weights versions the trainer published, in log order, across restarts."""
    return [event["version"] for event in trainer_events(run_dir, "weights_published")]


MAX_SKIPS = 10
"""Tries to find a live process of a kind before the monkey gives that kind up."""


@dataclass
class ChaosMonkey:
    """SIGKILLs `num_kills` processes of a live run (see the module docstring)."""

    launcher_pid: int
    run_dir: Path
    num_kills: int = 20
    seed: int = 0
    kinds: tuple[str, ...] = KINDS
    max_delay_s: float = 4.0
    stop_at_step: int | None = None
    """No kill once the run trained this step (leave it room to finish)."""
    recover_timeout_s: float = 300.0
    """A kill waits at most this long for a step after the previous one."""
    say: Callable[[str], None] = lambda text: print(text, file=sys.stderr, flush=True)
    kills: list[Kill] = field(default_factory=list)

    def newest_step(self) -> int:
        steps = trained_steps(self.run_dir)
        return max((step for step, _ in steps), default=0)

    def run(self) -> list[Kill]:
        rng = random.Random(self.seed)
        self.say(f"chaos: seed {self.seed}, {self.num_kills} kills over {', '.join(self.kinds)}")
        schedule: list[str] = []
        skips: dict[str, int] = {}
        while len(self.kills) < self.num_kills and process_marks.alive(self.launcher_pid):
            if not schedule:
                schedule = list(self.kinds)
                rng.shuffle(schedule)
            before = self.kills[-1].step_before if self.kills else 0
            if not self._wait_for_step_after(before):
                break
            step = self.newest_step()
            if self.stop_at_step is not None and step >= self.stop_at_step:
                break
            time.sleep(rng.uniform(0, self.max_delay_s))
            by_kind = processes_by_kind(self.launcher_pid)
            kind = schedule.pop(0)
            if not by_kind.get(kind):
                # Absent for now (e.g. the engine core while its replica restarts): try it again after
                # the rest of this round, so that every kind is still hit; give up on a kind only
                # after MAX_SKIPS misses (one the run does not have).
                skips[kind] = skips.get(kind, 0) + 1
                if skips[kind] < MAX_SKIPS:
                    schedule.append(kind)
                    self.say(f"chaos: no live {kind} process now; retried later")
                else:
                    self.say(f"chaos: no live {kind} process in {MAX_SKIPS} tries; skipped")
                continue
            pid = rng.choice(by_kind[kind])
            self._kill(kind, pid)
        return self.kills

    def _wait_for_step_after(self, step: int) -> bool:
        deadline = time.monotonic() + self.recover_timeout_s
        while time.monotonic() < deadline:
            if not process_marks.alive(self.launcher_pid):
                return False
            if self.newest_step() > step:
                return True
            time.sleep(0.5)
        self.say(f"chaos: no step after {step} within {self.recover_timeout_s:.0f} s; stopping")
        return False

    def _kill(self, kind: str, pid: int) -> None:
        step = self.newest_step()
        command = cmdline_of(pid)[:100]
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            self.say(f"chaos: {kind} pid {pid} was already gone")
            return
        self.kills.append(Kill(kind=kind, pid=pid, at=time.time(), step_before=step))
        self.say(
            f"chaos: kill {len(self.kills)}: SIGKILL {kind} pid {pid} at step {step} ({command})"
        )


def recovery(kills: list[Kill], run_dir: Path) -> list[dict]:
    """Per kill: seconds from the kill to the next step the trainer finished, and the steps lost
    (trained steps that the run trained again after the kill; 0 when nothing was repeated)."""
    steps = trained_steps(run_dir)
    rows = []
    for kill in kills:
        after = [(step, at) for step, at in steps if at > kill.at]
        next_step_s = after[0][1] - kill.at if after else None
        repeated = {step for step, _ in after if step <= kill.step_before}
        rows.append(
            {
                "kind": kill.kind,
                "step": kill.step_before,
                "recovery_s": next_step_s,
                "steps_lost": len(repeated),
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m rlbus_launch.chaos", description=__doc__.split("\n")[0]
    )
    parser.add_argument("launcher_pid", type=int, help="pid of the running `rl` launcher")
    parser.add_argument("run_dir", type=Path, help="its run directory")
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--seed", type=int, default=None, help="default: random (printed)")
    parser.add_argument("--kinds", default=",".join(KINDS), help="comma-separated process kinds")
    args = parser.parse_args(argv)
    kinds = tuple(k for k in args.kinds.split(",") if k)
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        print(f"--kinds: unknown {', '.join(unknown)}; known: {', '.join(KINDS)}", file=sys.stderr)
        return 2
    if not process_marks.alive(args.launcher_pid):
        print(f"launcher_pid: no live process {args.launcher_pid}", file=sys.stderr)
        return 2
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
    monkey = ChaosMonkey(args.launcher_pid, args.run_dir, args.kills, seed, kinds)
    kills = monkey.run()
    for row in recovery(kills, args.run_dir):
        print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
