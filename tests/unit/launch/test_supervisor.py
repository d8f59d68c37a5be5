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


def test_restart_policy_backs_off_doubling_to_the_cap_and_spends_its_budget_per_window():
    from rlbus.launch.supervisor import RestartPolicy

    policy = RestartPolicy(max_restarts=3, window_s=100, backoff_s=1, max_backoff_s=3)
    assert [policy.next_delay(t) for t in (0, 1, 2)] == [1, 2, 3]
    assert policy.next_delay(3) is None  # a 4th death within 100 s: budget spent
    assert policy.next_delay(99) is None
    assert policy.next_delay(100.5) == 3  # the first restart left the window
    assert policy.next_delay(250) == 1  # all left: back to the first backoff


def test_exit_descriptions_and_launcher_codes():
    from rlbus.launch.supervisor import describe_exit, launcher_exit_code

    assert describe_exit(-9) == "killed by SIGKILL" and describe_exit(1) == "exit code 1"
    assert launcher_exit_code(-9) == 137 and launcher_exit_code(0) == 1
    assert launcher_exit_code(2) == 2


def test_a_restarted_service_first_loses_every_marked_leftover(tmp_path):
    """A leader killed by SIGKILL leaves a child in another session; `end_leftovers` finds it by
    the mark and ends it, so a restart never meets its predecessor's processes."""
    import uuid

    from rlbus import procs

    service = make_service(
        tmp_path,
        "svc",
        SPAWNS_GRANDCHILD.replace(
            "subprocess.Popen([", "subprocess.Popen(start_new_session=True, args=["
        ),
    )
    service.launch_id = uuid.uuid4().hex
    service.start()
    deadline = time.monotonic() + 10
    while not service.log_path.read_text().strip() and time.monotonic() < deadline:
        time.sleep(0.05)
    child_pid = int(service.log_path.read_text().split()[0])
    os.kill(service.pid, 9)
    service.popen.wait(5)
    assert pid_alive(child_pid) and service.leftovers() == [child_pid]
    service.end_leftovers(grace_s=0.5)
    assert not pid_alive(child_pid)
    assert procs.marked_pids(service.launch_id) == []
