import os
import sys
import time

from rlbus.launch.supervisor import ServiceProcess, Supervisor


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
