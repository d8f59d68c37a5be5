"""rlbus.process_marks: marked processes are found across sessions and ended; the parent-death signal."""

import os
import signal
import subprocess
import sys
import time
import uuid

from rlbus import process_marks


def _spawn_marked(launch_id: str, service: str, *, new_session: bool = True) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"],
        env={**os.environ, **process_marks.mark_env(launch_id, service)},
        start_new_session=new_session,
    )


def test_marked_pids_finds_only_this_launch_and_service_then_terminate_ends_them():
    launch_id, other = uuid.uuid4().hex, uuid.uuid4().hex
    a = _spawn_marked(launch_id, "trainer")
    b = _spawn_marked(launch_id, "inference")
    c = _spawn_marked(other, "trainer")
    try:
        deadline = time.monotonic() + 10
        while len(process_marks.marked_pids(launch_id)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert process_marks.marked_pids(launch_id) == sorted([a.pid, b.pid])
        assert process_marks.marked_pids(launch_id, "trainer") == [a.pid]
        assert process_marks.service_of(b.pid) == "inference"
        assert str(a.pid) in process_marks.describe(
            a.pid
        ) and "time.sleep" in process_marks.describe(a.pid)
        assert process_marks.terminate(process_marks.marked_pids(launch_id), grace_s=5) == []
        a.wait(5), b.wait(5)
        assert a.returncode == -signal.SIGTERM and b.returncode == -signal.SIGTERM
        assert process_marks.marked_pids(launch_id) == []
        assert process_marks.alive(c.pid)
    finally:
        for p in (a, b, c):
            if p.poll() is None:
                p.kill()
                p.wait()


def test_die_with_parent_signals_a_grandchild_when_its_parent_is_killed():
    launch_id = uuid.uuid4().hex
    # The middle process starts a grandchild that asks for SIGTERM on its parent's death, prints
    # its pid, then waits; killing the middle one must end the grandchild too.
    middle_code = (
        "import subprocess, sys, time\n"
        "from rlbus import process_marks\n"
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'],"
        " preexec_fn=process_marks.die_with_parent)\n"
        "print(p.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    middle = subprocess.Popen(
        [sys.executable, "-c", middle_code],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, **process_marks.mark_env(launch_id, "x")},
    )
    try:
        grandchild = int(middle.stdout.readline())
        assert process_marks.alive(grandchild)
        middle.kill()
        middle.wait(5)
        deadline = time.monotonic() + 5
        while process_marks.alive(grandchild) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not process_marks.alive(grandchild)
    finally:
        if middle.poll() is None:
            middle.kill()
            middle.wait()
        process_marks.terminate(process_marks.marked_pids(launch_id), grace_s=1)
