import os
import sys
import time
import uuid

from rlbus import process_marks
from rlbus_launch.supervisor import ServiceProcess, Supervisor


def make_service(tmp_path, name, code):
    return ServiceProcess(
        name=name, argv=[sys.executable, "-c", code], log_path=tmp_path / "logs" / f"{name}.log"
    )


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie child of init is gone for our purposes
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


SPAWNS_GRANDCHILD = """
import subprocess, sys, time, signal
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a stubborn service
child = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(300)"])
print(child.pid, flush=True)
time.sleep(300)
"""


def test_stop_all_kills_stubborn_services_and_their_children(tmp_path):
    supervisor = Supervisor()
    service = supervisor.start(make_service(tmp_path, "stubborn", SPAWNS_GRANDCHILD))
    deadline = time.monotonic() + 10
    while not service.log_path.read_text().strip() and time.monotonic() < deadline:
        time.sleep(0.05)
    child_pid = int(service.log_path.read_text().split()[0])
    assert pid_alive(child_pid)
    supervisor.stop_all(timeout_s=0.5)
    assert not pid_alive(service.pid)
    assert not pid_alive(child_pid)


def test_first_failure_names_the_dead_service_and_keeps_its_log(tmp_path):
    supervisor = Supervisor()
    supervisor.start(make_service(tmp_path, "ok", "import time; time.sleep(30)"))
    bad = supervisor.start(
        make_service(tmp_path, "bad", "import sys; print('boom: bad config'); sys.exit(3)")
    )
    bad.popen.wait(10)
    failure = supervisor.first_failure()
    assert failure is not None and failure[0].name == "bad" and failure[1] == 3
    assert "boom: bad config" in bad.tail()
    supervisor.stop_all(timeout_s=2)


def test_a_service_expected_to_exit_cleanly_is_not_a_failure(tmp_path):
    supervisor = Supervisor()
    done = supervisor.start(make_service(tmp_path, "trainer", "pass"))
    done.popen.wait(10)
    assert supervisor.first_failure(expected_to_exit={"trainer"}) is None
    assert supervisor.first_failure() == (done, 0)


ESCAPES_THE_GROUP = """
import subprocess, sys, time, signal
signal.signal(signal.SIGTERM, signal.SIG_IGN)
# like a torchrun rank that left its agent's group: own session, ignores SIGTERM
child = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(300)"], start_new_session=True)
print(child.pid, flush=True)
time.sleep(300)
"""


def started_child(service) -> int:
    deadline = time.monotonic() + 10
    while not service.log_path.read_text().strip() and time.monotonic() < deadline:
        time.sleep(0.05)
    return int(service.log_path.read_text().split()[0])


def test_marked_processes_that_left_the_group_are_ended_with_their_service(tmp_path):
    launch_id = uuid.uuid4().hex
    supervisor = Supervisor()
    service = make_service(tmp_path, "trainer", ESCAPES_THE_GROUP)
    service.launch_id = launch_id
    supervisor.start(service)
    try:
        escaped = started_child(service)
        assert process_marks.service_of(escaped) == "trainer"
        assert sorted(process_marks.marked_pids(launch_id)) == sorted([service.pid, escaped])
        supervisor.stop_all(timeout_s=0.5)
        assert not pid_alive(escaped) and process_marks.marked_pids(launch_id) == []
    finally:
        process_marks.terminate(process_marks.marked_pids(launch_id), grace_s=0)


def test_stop_now_kills_every_group_and_marked_process_at_once(tmp_path):
    launch_id = uuid.uuid4().hex
    supervisor = Supervisor()
    services = [make_service(tmp_path, f"s{i}", ESCAPES_THE_GROUP) for i in range(2)]
    for service in services:
        service.launch_id = launch_id
        supervisor.start(service)
    try:
        escaped = [started_child(s) for s in services]
        began = time.monotonic()
        supervisor.stop_now()
        assert time.monotonic() - began < 10
        assert process_marks.marked_pids(launch_id) == [] and not any(pid_alive(p) for p in escaped)
    finally:
        process_marks.terminate(process_marks.marked_pids(launch_id), grace_s=0)


def test_a_restarted_service_runs_the_same_argv_and_appends_to_its_log(tmp_path):
    supervisor = Supervisor()
    service = supervisor.start(make_service(tmp_path, "monitor", "print('started', flush=True)"))
    service.popen.wait(10)
    first = service.pid
    service.start()
    service.popen.wait(10)
    assert service.pid != first
    assert service.log_path.read_text().split() == ["started", "started"]
    supervisor.stop_all(timeout_s=1)
