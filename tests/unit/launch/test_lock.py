"""The run-directory lock (`launcher.json`): a live launcher or live marked processes make a new
`rl` refuse, naming them; a stale lock is ignored."""

import json
import os
import subprocess
import sys
import uuid

import pytest

from rlbus import process_marks
from rlbus_launch.lock import (
    LOCK_FILE,
    LauncherLock,
    lock_path,
    read_lock,
    refusal,
    remove_lock,
    write_lock,
)


@pytest.fixture
def started():
    """Processes a test starts; each is killed by PID at teardown."""
    popens: list[subprocess.Popen] = []
    yield popens
    for popen in popens:
        popen.kill()
        popen.wait(10)


def sleeper(started, env: dict[str, str] | None = None) -> subprocess.Popen:
    popen = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(120)"], env={**os.environ, **(env or {})}
    )
    started.append(popen)
    return popen


def put_lock(run_dir, pid: int, launch_id: str) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    lock = {"pid": pid, "launch_id": launch_id, "host": os.uname().nodename, "started_at": 0.0}
    (run_dir / LOCK_FILE).write_text(json.dumps(lock))


def test_written_lock_names_this_process_and_is_removed_only_by_its_launch(tmp_path):
    lock = write_lock(tmp_path, "abc")
    assert read_lock(tmp_path) == lock
    assert isinstance(lock, LauncherLock) and lock.pid == os.getpid()
    remove_lock(tmp_path, "another-launch")
    assert lock_path(tmp_path).exists()
    remove_lock(tmp_path, "abc")
    assert not lock_path(tmp_path).exists()


def test_no_lock_or_a_garbage_lock_is_free(tmp_path):
    assert refusal(tmp_path) is None
    (tmp_path / LOCK_FILE).write_text("{not json")
    assert read_lock(tmp_path) is None and refusal(tmp_path) is None


def test_a_live_launcher_pid_is_refused_with_how_to_stop_it(tmp_path, started):
    launcher = sleeper(started)
    put_lock(tmp_path, launcher.pid, uuid.uuid4().hex)
    message = refusal(tmp_path)
    assert message is not None
    assert f"pid {launcher.pid} (" in message and "[rl launcher]" in message
    assert f"kill {launcher.pid}" in message and "Ctrl-C" in message


def test_live_marked_processes_are_refused_even_when_the_launcher_is_gone(tmp_path, started):
    launch_id = uuid.uuid4().hex
    dead = sleeper(started)
    dead.kill()
    dead.wait(10)
    orphan = sleeper(started, process_marks.mark_env(launch_id, "trainer"))
    put_lock(tmp_path, dead.pid, launch_id)
    message = refusal(tmp_path)
    assert message is not None
    assert f"pid {orphan.pid} (" in message and "[trainer]" in message
    assert f"kill {orphan.pid}" in message and "[rl launcher]" not in message


def test_a_stale_lock_is_ignored(tmp_path, started):
    launch_id = uuid.uuid4().hex
    gone = sleeper(started, process_marks.mark_env(launch_id, "monitor"))
    gone.kill()
    gone.wait(10)
    put_lock(tmp_path, gone.pid, launch_id)
    assert refusal(tmp_path) is None
