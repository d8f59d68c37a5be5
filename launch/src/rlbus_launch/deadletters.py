"""List a run's quarantined messages: `python -m rlbus_launch.deadletters <run_dir>` (`rl dead-letters`).

    python -m rlbus_launch.deadletters outputs/my-run             # table: seq, time, kind, subject, origin, reason
    python -m rlbus_launch.deadletters outputs/my-run --json      # one JSON object per dead letter
    python -m rlbus_launch.deadletters --bus.url nats://nats:4222 --run-id my-run

With a run directory the bus comes from the run's resolved config (`<run_dir>/configs/rl.toml`;
its embedded server's address from `configs/nats.conf`). When that embedded server is not running
any more, a temporary one is started on the run's store (`<run_dir>/nats`) on a free port, read,
and stopped. Exit 0 (also with no dead letters: `no dead letters`), 2 with one line for a bad run
directory or a bus that does not answer. What the records mean: docs/bus.md, "Dead letters".
"""

import argparse
import asyncio
import datetime
import json
import sys
from pathlib import Path

import msgspec

from rlbus.bus.client import Bus
from rlbus.bus.core import DeadLetter
from rlbus.bus.errors import BusError
from rlbus.configs.bus import BusConfig
from rlbus.secrets import SecretError
from rlbus_launch.natsserver import NatsServer

PROG = "rl dead-letters"
EXIT_OK = 0
EXIT_USAGE = 2
CONNECT_RETRY_S = 2.0
"""How long the run's bus is tried before it counts as not running."""
COLUMNS = ("seq", "time", "kind", "subject", "origin", "reason")
REASON_MAX_CHARS = 160


class DeadLettersError(Exception):
    """A bad run directory or an unreachable bus: printed as one line, exit 2."""


def format_time(seconds: float) -> str:
    return datetime.datetime.fromtimestamp(seconds, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def table(letters: list[DeadLetter]) -> str:
    """Fixed-width table of `COLUMNS`, one line per dead letter (reasons on one line, shortened)."""
    rows = [COLUMNS] + [
        (
            str(d.seq),
            format_time(d.time),
            d.kind,
            d.subject,
            d.origin,
            " ".join(d.reason.split())[:REASON_MAX_CHARS],
        )
        for d in letters
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS) - 1)]
    return "\n".join(
        "  ".join(
            [*(cell.ljust(width) for cell, width in zip(row[:-1], widths, strict=True)), row[-1]]
        ).rstrip()
        for row in rows
    )


def run_bus_config(run_dir: Path) -> tuple[BusConfig, str, bool]:
    """(bus config, run id, whether the bus is the run's embedded server) of a run directory,
    from the config the launcher wrote."""
    from rlbus.configs import RLConfig
    from rlbus.configs.base import parse_cli
    from rlbus.rundirs import run_id_of

    rl_toml = run_dir / "configs" / "rl.toml"
    if not rl_toml.is_file():
        raise DeadLettersError(
            f"{run_dir} is not a run directory (no configs/rl.toml): pass the directory `rl` "
            "printed at start, or --bus.url URL --run-id ID for a live bus"
        )
    try:
        config = parse_cli(RLConfig, ["@", str(rl_toml)], prog=PROG)
    except SystemExit as error:  # parse_cli printed what is wrong with the file
        raise DeadLettersError(f"{rl_toml} does not load (see above)") from error
    bus = config.bus.model_copy()
    embedded = bus.url is None
    if embedded:  # its address is in the nats.conf the launcher wrote
        bus.url = embedded_url(run_dir)
    run_id = run_id_of(bus.run_id, config.run.name, str(run_dir))
    assert run_id is not None
    return bus, run_id, embedded


def embedded_url(run_dir: Path) -> str:
    conf = run_dir / "configs" / "nats.conf"
    try:
        server = json.loads(conf.read_text())
        return f"nats://{server['host']}:{server['port']}"
    except (OSError, ValueError, KeyError) as error:
        raise DeadLettersError(
            f"{conf} is missing or unreadable ({error}): the run has no embedded bus; "
            "pass --bus.url URL --run-id ID"
        ) from error


def embedded_server_running(run_dir: Path) -> int | None:
    """PID of a live process started with the run's `configs/nats.conf`, if any (read-only scan)."""
    conf = str((run_dir / "configs" / "nats.conf").absolute())
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if conf.encode() in argv:
            return int(proc.name)
    return None


async def read_dead_letters(config: BusConfig, run_id: str) -> list[DeadLetter]:
    bus = await Bus.connect(config, run_id=run_id, name="dead-letters", ensure=False)
    try:
        return await bus.dead_letters()
    finally:
        await bus.close()


async def read_run_dir(run_dir: Path) -> list[DeadLetter]:
    """The dead letters of a run directory; a temporary server on its store if its bus is down."""
    config, run_id, embedded = run_bus_config(run_dir)
    quick = config.model_copy(update={"connect_retry_s": CONNECT_RETRY_S})
    try:
        return await read_dead_letters(quick, run_id)
    except BusError as error:
        if not embedded:
            raise DeadLettersError(
                f"the run's bus at {config.url} does not answer: {error}"
            ) from None
        pid = embedded_server_running(run_dir)
        if pid is not None:
            raise DeadLettersError(
                f"the run's nats-server (pid {pid}) is running but does not answer at {config.url}"
            ) from None
    store = run_dir / "nats"
    if not (store / "jetstream").is_dir():
        raise DeadLettersError(f"{run_dir} has no NATS store ({store}/jetstream): nothing to read")
    server = NatsServer.for_config(
        config, store, log_file=run_dir / "logs" / "dead-letters-nats.log"
    )
    await asyncio.to_thread(server.start)
    try:
        return await read_dead_letters(quick.model_copy(update={"url": server.url}), run_id)
    finally:
        await asyncio.to_thread(server.stop)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=PROG, description="List the messages a run quarantined (its dead letters)."
    )
    parser.add_argument("run_dir", nargs="?", type=Path, help="the run directory")
    parser.add_argument("--bus.url", dest="url", help="a live bus (instead of a run directory)")
    parser.add_argument("--bus.token-file", dest="token_file", help="0600 file with its token")
    parser.add_argument("--bus.user", dest="user", help="user on that bus (e.g. admin)")
    parser.add_argument("--bus.password-file", dest="password_file", help="0600 file, its password")
    parser.add_argument("--bus.tls-ca", dest="tls_ca", help="CA of a TLS bus")
    parser.add_argument("--run-id", help="the run id on that bus (with --bus.url)")
    parser.add_argument("--json", action="store_true", help="one JSON object per line")
    args = parser.parse_args(argv)
    if (args.run_dir is None) == (args.url is None):
        parser.error("pass a run directory, or --bus.url URL --run-id ID")
    if args.url is not None and not args.run_id:
        parser.error("--bus.url needs --run-id ID")
    return args


def main(argv: list[str] | None = None) -> int:
    """List the dead letters (module docstring); returns the exit code."""
    from rlbus.obs.logging import setup_logging

    args = parse_args(argv)
    setup_logging("dead-letters", level="error")  # stdout is the listing
    try:
        if args.run_dir is not None:
            letters = asyncio.run(read_run_dir(args.run_dir))
        else:
            config = BusConfig(
                url=args.url,
                token_file=args.token_file,
                user=args.user,
                password_file=args.password_file,
                tls_ca=args.tls_ca,
                connect_retry_s=CONNECT_RETRY_S,
            )
            letters = asyncio.run(read_dead_letters(config, args.run_id))
    except (DeadLettersError, SecretError) as error:
        print(f"dead-letters: {error}", file=sys.stderr)
        return EXIT_USAGE
    except BusError as error:
        print(f"dead-letters: {error}", file=sys.stderr)
        return EXIT_USAGE
    if args.json:
        for letter in letters:
            print(msgspec.json.encode(letter).decode())
    elif letters:
        print(table(letters))
    else:
        print("no dead letters")
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
