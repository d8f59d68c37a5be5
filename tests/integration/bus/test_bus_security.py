"""A secured NATS server (rlbus.bus.natsauth: per-role users, subject permissions, TLS) against
real clients: who may publish what, and how fast and how clearly a wrong setup fails."""

import asyncio
import base64
import hashlib
import json
import os
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import nkeys
import pytest
import structlog
from bus_factories import make_task

from rlbus.bus import Bus
from rlbus.bus.errors import BusAuthError, BusTLSError
from rlbus.bus.natsauth import ROLES, write_security_dir
from rlbus.configs.bus import BusConfig
from rlbus.secrets import write_secret_file
from rlbus.wire.subjects import RunSubjects
from rlbus_launch.natsserver import NatsServer

RUN = "sec"
FAIL_FAST_S = 10.0
"""Issue 15: a wrong CA, wrong credentials or a TLS mismatch fails within this."""


@pytest.fixture(scope="module")
def security_dir(tmp_path_factory):
    return write_security_dir(tmp_path_factory.mktemp("secrets") / "nats", RUN, ["127.0.0.1"])


@pytest.fixture(scope="module")
def secured_server(security_dir, tmp_path_factory):
    server = NatsServer(tmp_path_factory.mktemp("store"), security_dir=security_dir).start()
    try:
        yield server
    finally:
        server.stop(timeout_s=5)
        server.kill()


def role_config(server: NatsServer, security_dir, role: str, **overrides) -> BusConfig:
    fields = dict(
        url=server.url,
        user=role,
        password_file=str(security_dir / f"{role}.password"),
        tls_ca=str(security_dir / "ca.pem"),
        connect_retry_s=5.0,
    )
    return BusConfig(**(fields | overrides))


async def publish_outcome(bus: Bus, subject: str) -> str:
    """ "allowed" or "denied": a core publish, then a flush (the server answers a permission
    violation with -ERR before the PONG)."""
    with structlog.testing.capture_logs() as logs:
        await bus.nc.publish(subject, b"{}")
        await bus.nc.flush(timeout=5)
        await asyncio.sleep(0.05)
    errors = [entry["error"] for entry in logs if entry["event"] == "nats_error"]
    if any(
        f'permissions violation for publish to "{subject.lower()}"' in e.lower() for e in errors
    ):
        return "denied"
    assert not errors, errors
    return "allowed"


S = RunSubjects(RUN)
WEIGHTS = f"$KV.{S.weights_bucket}.latest"
REPLICA = f"$KV.{S.replicas_bucket}.replica-0"
STATE = f"$KV.{S.state_bucket}.finished"
DELETE_TASKS = f"$JS.API.STREAM.DELETE.{S.tasks_stream}"
# (role, subject, outcome): what each service must do, and the neighbours' subjects it must not.
CASES = [
    ("trainer", WEIGHTS, "allowed"),
    ("trainer", STATE, "allowed"),
    ("trainer", S.weights_published, "allowed"),
    ("trainer", S.batch(1), "denied"),
    ("trainer", S.tasks, "denied"),
    ("orchestrator", S.batch(1), "allowed"),
    ("orchestrator", S.tasks, "allowed"),
    ("orchestrator", S.rollouts, "allowed"),
    ("orchestrator", WEIGHTS, "denied"),
    ("orchestrator", REPLICA, "denied"),
    ("worker", S.rollouts, "allowed"),
    ("worker", S.lifecycle("worker"), "allowed"),
    ("worker", WEIGHTS, "denied"),
    ("worker", S.weights_published, "denied"),
    ("worker", S.batch(1), "denied"),
    ("worker", S.tasks, "denied"),
    ("worker", STATE, "denied"),
    ("inference", REPLICA, "allowed"),
    ("inference", S.weights_applied, "allowed"),
    ("inference", S.batch(1), "denied"),
    ("inference", S.tasks, "denied"),
    ("inference", WEIGHTS, "denied"),
    ("inference", S.rollouts, "denied"),
    ("monitor", S.metrics("monitor"), "allowed"),
    ("monitor", S.rollouts, "denied"),
    ("monitor", WEIGHTS, "denied"),
    *[(role, DELETE_TASKS, "denied") for role in ROLES if role != "admin"],
    *[(role, "rlbus.other_run.tasks", "denied") for role in ROLES if role != "admin"],
    ("admin", S.batch(1), "allowed"),
]


@pytest.mark.parametrize(("role", "subject", "outcome"), CASES)
async def test_each_role_publishes_only_its_own_subjects(
    secured_server, security_dir, role, subject, outcome
):
    bus = await Bus.connect(role_config(secured_server, security_dir, role), run_id=RUN, name=role)
    try:
        assert await publish_outcome(bus, subject) == outcome
    finally:
        await bus.close()


async def test_a_worker_publishes_a_rollout_but_its_weights_put_is_refused(
    secured_server, security_dir
):
    worker = await Bus.connect(role_config(secured_server, security_dir, "worker"), run_id=RUN)
    try:
        ack = await worker.js.publish(worker.subjects.rollouts, b"{}")
        assert ack.stream == worker.subjects.rollouts_stream
        with pytest.raises(Exception) as refused:  # no ack: the server dropped the put
            await worker.js.publish(WEIGHTS, b"{}", timeout=1.0)
        assert "timeout" in type(refused.value).__name__.lower()
    finally:
        await worker.close()


async def test_plaintext_client_against_the_tls_server_fails_fast(secured_server, security_dir):
    url = secured_server.url.replace("tls://", "nats://")
    config = role_config(secured_server, security_dir, "worker", url=url, tls_ca=None)
    started = time.monotonic()
    with pytest.raises(BusTLSError, match=f"NATS at {url} requires TLS.*tls_ca"):
        await Bus.connect(config, run_id=RUN)
    assert time.monotonic() - started < FAIL_FAST_S


async def test_a_ca_that_did_not_sign_the_server_fails_fast(secured_server, security_dir, tmp_path):
    other = write_security_dir(tmp_path / "other", RUN, ["127.0.0.1"])
    config = role_config(secured_server, security_dir, "worker", tls_ca=str(other / "ca.pem"))
    started = time.monotonic()
    with pytest.raises(BusTLSError, match="certificate is not trusted.*bus.tls_ca"):
        await Bus.connect(config, run_id=RUN)
    assert time.monotonic() - started < FAIL_FAST_S


async def test_a_wrong_password_fails_fast(secured_server, security_dir, tmp_path):
    wrong = write_secret_file(tmp_path / "wrong.password", "not-the-password")
    config = role_config(secured_server, security_dir, "trainer", password_file=str(wrong))
    started = time.monotonic()
    with pytest.raises(BusAuthError, match="refused the credentials.*bus.password_file"):
        await Bus.connect(config, run_id=RUN)
    assert time.monotonic() - started < FAIL_FAST_S


async def test_another_roles_password_does_not_log_in(secured_server, security_dir):
    config = role_config(secured_server, security_dir, "trainer")
    config.password_file = str(security_dir / "worker.password")
    with pytest.raises(BusAuthError):
        await Bus.connect(config, run_id=RUN)


async def test_a_wrong_token_fails_fast(tmp_path):
    server = NatsServer(tmp_path / "store", token="right-token").start()
    try:
        wrong = write_secret_file(tmp_path / "token", "wrong-token")
        config = BusConfig(url=server.url, token_file=str(wrong), connect_retry_s=30)
        started = time.monotonic()
        with pytest.raises(BusAuthError, match=f"NATS at {server.url} refused"):
            await Bus.connect(config, run_id=RUN)
        assert time.monotonic() - started < FAIL_FAST_S
    finally:
        server.kill()


class FakePlaintextServer:
    """A TCP listener that speaks the first line of NATS (INFO without TLS) and records what the
    client sends back: a TLS client must hang up before any CONNECT (its credentials)."""

    def __init__(self):
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.received = b""
        self.thread = threading.Thread(target=self.serve, daemon=True)
        self.thread.start()

    def serve(self) -> None:
        self.listener.settimeout(10)
        try:
            conn, _ = self.listener.accept()
        except TimeoutError:
            return
        with conn:
            conn.sendall(
                b'INFO {"server_id":"fake","auth_required":true,"max_payload":1048576}\r\n'
            )
            conn.settimeout(2)
            try:
                while chunk := conn.recv(4096):
                    self.received += chunk
            except TimeoutError:
                pass

    def close(self) -> None:
        self.listener.close()
        self.thread.join(5)


async def test_a_tls_client_never_sends_credentials_to_a_plaintext_server(tmp_path, security_dir):
    fake = FakePlaintextServer()
    try:
        url = f"tls://127.0.0.1:{fake.port}"
        token = write_secret_file(tmp_path / "token", "the-secret-token")
        config = BusConfig(
            url=url, token_file=str(token), tls_ca=str(security_dir / "ca.pem"), connect_retry_s=30
        )
        started = time.monotonic()
        with pytest.raises(BusTLSError, match=f"NATS at {url} offers no TLS.*refusing plaintext"):
            await Bus.connect(config, run_id=RUN)
        assert time.monotonic() - started < FAIL_FAST_S
    finally:
        fake.close()
    assert b"CONNECT" not in fake.received and b"the-secret-token" not in fake.received


async def test_a_tls_client_refuses_a_real_plaintext_server(tmp_path, security_dir):
    server = NatsServer(tmp_path / "store").start()
    try:
        url = server.url.replace("nats://", "tls://")
        config = BusConfig(url=url, tls_ca=str(security_dir / "ca.pem"))
        started = time.monotonic()
        with pytest.raises(BusTLSError, match="offers no TLS"):
            await Bus.connect(config, run_id=RUN)
        assert time.monotonic() - started < FAIL_FAST_S
    finally:
        server.kill()


async def test_nkey_seed_file_authenticates(tmp_path):
    seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)
    public = nkeys.from_seed(bytearray(seed)).public_key.decode()
    server = NatsServer(tmp_path / "store", users=[{"nkey": public}]).start()
    try:
        seed_file = write_secret_file(tmp_path / "user.nk", seed.decode())
        bus = await Bus.connect(
            BusConfig(url=server.url, nkey_seed_file=str(seed_file)), run_id=RUN
        )
        try:
            assert (await bus.publish(bus.subjects.tasks, make_task(0), msg_id="0-0")).seq == 1
        finally:
            await bus.close()
        other = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)
        other_file = write_secret_file(tmp_path / "other.nk", other.decode())
        with pytest.raises(BusAuthError):
            await Bus.connect(BusConfig(url=server.url, nkey_seed_file=str(other_file)), run_id=RUN)
    finally:
        server.kill()


ROOT = Path(__file__).resolve().parents[3]
LAUNCH_SECRET = "launch-tok-8e2d41"


def start_script(script: Path, log: Path) -> subprocess.Popen:
    """A run-directory script in its own session, without the token in its environment (the
    children must find it in the run directory's secret file)."""
    env = {k: v for k, v in os.environ.items() if k != "RLBUS_BUS_TOKEN"}
    with open(log, "ab") as out:
        return subprocess.Popen(
            ["bash", str(script)], stdout=out, stderr=subprocess.STDOUT, env=env,
            start_new_session=True,
        )  # fmt: skip


def connection_names(monitor_url: str) -> list[str]:
    with urllib.request.urlopen(f"{monitor_url}/connz", timeout=2) as resp:
        return [c.get("name", "") for c in json.load(resp)["connections"] or []]


def test_a_launched_run_shows_its_token_in_no_argv_and_no_readable_file(tmp_path):
    env = os.environ | {"RLBUS_BUS_TOKEN": LAUNCH_SECRET}
    rl = Path(sys.executable).parent / "rl"
    subprocess.run(
        [rl, "@", ROOT / "configs/debug/rl.toml", "--dry-run", "--output-dir", tmp_path,
         "--run.name", "r"],
        cwd=ROOT, check=True, capture_output=True, timeout=60, env=env,
    )  # fmt: skip
    run_dir = tmp_path / "r"
    conf = json.loads((run_dir / "configs" / "nats.conf").read_text())
    server_url = f"http://127.0.0.1:{conf['http'].rsplit(':', 1)[1]}"
    started = []
    try:
        started.append(start_script(run_dir / "scripts" / "nats.sh", tmp_path / "nats.log"))
        wait_until(lambda: healthy(server_url), 15)
        started.append(start_script(run_dir / "scripts" / "monitor.sh", tmp_path / "monitor.log"))
        wait_until(lambda: len(connection_names(server_url)) >= 1, 30)  # the monitor got in
        pids = {str(p.pid) for p in started}
        args = subprocess.run(["ps", "-eo", "pid=,args="], capture_output=True, text=True).stdout
        ours = [line for line in args.splitlines() if line.split(None, 1)[0] in pids]
        assert len(ours) == 2 and all(LAUNCH_SECRET not in line for line in ours), ours
        assert LAUNCH_SECRET not in args
    finally:
        for process in started:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
        for process in started:
            try:
                process.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
    readable = [
        p for p in run_dir.rglob("*")
        if p.is_file() and LAUNCH_SECRET in p.read_text(errors="replace")
        and stat.S_IMODE(p.stat().st_mode) & 0o077
    ]  # fmt: skip
    assert readable == []
    assert LAUNCH_SECRET not in "".join(p.read_text() for p in (run_dir / "logs").glob("*.log"))


def healthy(monitor_url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{monitor_url}/healthz?js-enabled-only=true", timeout=1):
            return True
    except OSError:
        return False


def wait_until(predicate, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"not within {timeout_s}s"
        time.sleep(0.2)


async def test_the_shipped_nats_conf_serves_tls_with_the_generated_users(tmp_path, free_ports):
    port, http_port = free_ports(2)
    conf = (ROOT / "deploy" / "nats.conf").read_text()
    conf = conf.replace("port: 4222", f"port: {port}").replace(":8222", f":{http_port}")
    conf = conf.replace("/data/nats", str(tmp_path / "jetstream"))
    (tmp_path / "nats.conf").write_text(conf)
    security = write_security_dir(tmp_path / "secrets", RUN, ["127.0.0.1"])
    binary = Path(sys.executable).parent / "nats-server"
    process = subprocess.Popen(
        [binary, "-c", str(tmp_path / "nats.conf")],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    try:
        await asyncio.to_thread(wait_until, lambda: healthy(f"http://127.0.0.1:{http_port}"), 15)
        config = BusConfig(
            url=f"tls://127.0.0.1:{port}",
            user="orchestrator",
            password_file=str(security / "orchestrator.password"),
            tls_ca=str(security / "ca.pem"),
        )
        bus = await Bus.connect(config, run_id=RUN)
        try:
            assert (await bus.publish(bus.subjects.tasks, make_task(0), msg_id="0-0")).seq == 1
            assert await publish_outcome(bus, WEIGHTS) == "denied"
        finally:
            await bus.close()
        plain = BusConfig(url=f"nats://127.0.0.1:{port}", connect_retry_s=5)
        with pytest.raises(BusTLSError):
            await Bus.connect(plain, run_id=RUN)
    finally:
        process.terminate()
        process.wait(10)


@pytest.mark.timeout(120)
async def test_the_secured_sidecar_issues_its_certificate_and_exits_when_the_run_finishes(
    tmp_path, free_ports
):
    """`rlbus-nats --security-dir --tls-host` as SLURM starts it: a certificate for the host it
    is told at start (none before), TLS only, and the run's end seen through its admin user."""
    port, http_port = free_ports(2)
    security = tmp_path / "secrets"
    write_security_dir(security, RUN, ["only-a-placeholder"])
    argv = [Path(sys.executable).parent / "rlbus-nats", "--store", tmp_path / "store",
            "--host", "0.0.0.0", "--port", str(port), "--http-port", str(http_port),
            "--run-id", RUN, "--exit-when-finished", "--linger-s", "5",
            "--security-dir", security, "--tls-host", "127.0.0.1"]  # fmt: skip
    log = tmp_path / "rlbus-nats.log"
    with log.open("wb") as out:
        process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    try:
        await asyncio.to_thread(wait_until, lambda: "nats-server ready" in log.read_text(), 30)
        url = f"tls://127.0.0.1:{port}"
        trainer = BusConfig(
            url=url, user="trainer", password_file=str(security / "trainer.password"),
            tls_ca=str(security / "ca.pem"),
        )  # fmt: skip
        bus = await Bus.connect(trainer, run_id=RUN, name="trainer")
        await bus.mark_finished(last_step=1)
        await bus.close()
        code = await asyncio.to_thread(process.wait, 30)
        assert code == 0, log.read_text()
    finally:
        if process.poll() is None:
            process.terminate()
            process.wait(15)


def b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def nkey_pair(prefix: int) -> tuple[bytes, "nkeys.KeyPair", str]:
    seed = nkeys.encode_seed(os.urandom(32), prefix)
    pair = nkeys.from_seed(bytearray(seed))
    return seed, pair, pair.public_key.decode()


def signed_jwt(issuer: "nkeys.KeyPair", issuer_public: str, subject: str, nats: dict) -> str:
    """A NATS JWT (v2 claims, ed25519-nkey) like `nsc` writes, signed by `issuer`."""
    header = b64url(json.dumps({"typ": "JWT", "alg": "ed25519-nkey"}).encode())
    claims = {"iat": int(time.time()), "iss": issuer_public, "sub": subject, "nats": nats}
    digest = hashlib.sha256(json.dumps(claims).encode()).digest()
    claims["jti"] = base64.b32encode(digest).decode().rstrip("=")
    payload = b64url(json.dumps(claims).encode())
    signature = issuer.sign(f"{header}.{payload}".encode())
    return f"{header}.{payload}.{b64url(signature)}"


UNLIMITED = {"subs": -1, "data": -1, "payload": -1, "imports": -1, "exports": -1,
             "wildcards": True, "conn": -1, "leaf": -1}  # fmt: skip


def operator_mode_conf(tmp_path: Path, port: int, http_port: int) -> tuple[str, Path]:
    """(server config, creds file of one user): an operator, a JetStream-enabled account with a
    user, and the system account JetStream needs; all keys made here with nkeys."""
    _, operator, operator_public = nkey_pair(nkeys.PREFIX_BYTE_OPERATOR)
    _, account, account_public = nkey_pair(nkeys.PREFIX_BYTE_ACCOUNT)
    _, _, system_public = nkey_pair(nkeys.PREFIX_BYTE_ACCOUNT)
    user_seed, _, user_public = nkey_pair(nkeys.PREFIX_BYTE_USER)
    operator_jwt = signed_jwt(operator, operator_public, operator_public,
                              {"type": "operator", "version": 2})  # fmt: skip
    storage = {"mem_storage": -1, "disk_storage": -1, "streams": -1, "consumer": -1}
    account_jwt = signed_jwt(operator, operator_public, account_public,
                             {"limits": UNLIMITED | storage, "type": "account", "version": 2})  # fmt: skip
    system_jwt = signed_jwt(operator, operator_public, system_public,
                            {"limits": UNLIMITED, "type": "account", "version": 2})  # fmt: skip
    user_jwt = signed_jwt(account, account_public, user_public,
                          {"pub": {}, "sub": {}, "subs": -1, "data": -1, "payload": -1,
                           "type": "user", "version": 2})  # fmt: skip
    conf = f"""port: {port}
http: "127.0.0.1:{http_port}"
jetstream {{ store_dir: "{tmp_path / "jetstream"}" }}
operator: "{operator_jwt}"
system_account: {system_public}
resolver: MEMORY
resolver_preload: {{ {account_public}: "{account_jwt}", {system_public}: "{system_jwt}" }}
"""
    creds = (
        f"-----BEGIN NATS USER JWT-----\n{user_jwt}\n------END NATS USER JWT------\n\n"
        f"-----BEGIN USER NKEY SEED-----\n{user_seed.decode()}\n------END USER NKEY SEED------\n"
    )
    return conf, write_secret_file(tmp_path / "user.creds", creds)


async def test_a_creds_file_authenticates_against_an_operator_mode_server(tmp_path, free_ports):
    port, http_port = free_ports(2)
    conf, creds = operator_mode_conf(tmp_path, port, http_port)
    (tmp_path / "nats.conf").write_text(conf)
    process = subprocess.Popen(
        [Path(sys.executable).parent / "nats-server", "-c", tmp_path / "nats.conf"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        await asyncio.to_thread(wait_until, lambda: healthy(f"http://127.0.0.1:{http_port}"), 15)
        url = f"nats://127.0.0.1:{port}"
        bus = await Bus.connect(BusConfig(url=url, creds_file=str(creds)), run_id=RUN)
        try:
            assert (await bus.publish(bus.subjects.tasks, make_task(0), msg_id="0-0")).seq == 1
        finally:
            await bus.close()
        _, stranger = operator_mode_conf(tmp_path / "other", port, http_port)  # unknown account
        started = time.monotonic()
        with pytest.raises(BusAuthError, match="bus.creds_file"):
            await Bus.connect(BusConfig(url=url, creds_file=str(stranger)), run_id=RUN)
        assert time.monotonic() - started < FAIL_FAST_S
        creds.chmod(0o644)
        with pytest.raises(ValueError, match="chmod 600"):
            await Bus.connect(BusConfig(url=url, creds_file=str(creds)), run_id=RUN)
    finally:
        process.terminate()
        process.wait(10)


async def test_a_role_share_holds_only_that_roles_password_and_logs_in(
    secured_server, security_dir, tmp_path
):
    """`rlbus-nats-config --share worker=DIR` (compose mounts DIR into the worker only)."""
    share = tmp_path / "share-worker"
    done = subprocess.run(
        [sys.executable, "-m", "rlbus.bus.natsauth", "--dir", str(security_dir), "--run-id", RUN,
         "--share", f"worker={share}"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in share.iterdir()) == ["ca.pem", "worker.password"]
    assert stat.S_IMODE((share / "worker.password").stat().st_mode) == 0o600
    worker = await Bus.connect(role_config(secured_server, share, "worker"), run_id=RUN)
    await worker.close()
    bad = subprocess.run(
        [sys.executable, "-m", "rlbus.bus.natsauth", "--dir", str(security_dir), "--run-id", RUN,
         "--share", f"pilot={share}"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert bad.returncode == 2 and "--share 'pilot=" in bad.stderr and "Traceback" not in bad.stderr
