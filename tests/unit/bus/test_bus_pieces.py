"""Bus pieces that need no server: connection options, claim-check files, server config."""

import asyncio
import json

import pytest

from rlbus.bus import claimcheck
from rlbus.bus.connection import connect_options, is_auth_error
from rlbus.bus.errors import ClaimCheckError
from rlbus.configs.bus import BusConfig
from rlbus_launch.natsserver import NatsServer


def test_connect_options_carry_auth_and_fail_fast_first():
    options = connect_options(BusConfig(url="nats://h:4222").with_secrets(token="t"), name="svc")
    assert (
        options["servers"] == ["nats://h:4222"]
        and options["token"] == "t"
        and options["name"] == "svc"
    )
    assert options["allow_reconnect"] is False  # flipped to forever once connected
    config = BusConfig(url="nats://h:4222", user="u").with_secrets(password="p")
    options = connect_options(config, name="svc")
    assert (options["user"], options["password"]) == ("u", "p")
    assert "token" not in options


def test_connect_without_url_names_the_flag():
    with pytest.raises(ValueError, match="bus.url"):
        connect_options(BusConfig(), name="svc")


def test_tls_options_build_a_context_from_the_ca(tmp_path):
    with pytest.raises(FileNotFoundError):
        connect_options(
            BusConfig(url="tls://h:4222", tls_ca=str(tmp_path / "missing.pem")), name="svc"
        )


def test_auth_errors_are_recognised():
    assert is_auth_error(Exception("nats: 'Authorization Violation'"))
    assert not is_auth_error(ConnectionRefusedError("refused"))


def test_claim_check_round_trip_and_corruption(tmp_path):
    claim = claimcheck.store(tmp_path, "rlbus.r.batches.1", b"payload" * 1000, "batch-1")
    assert not claim.path.startswith("/")
    assert claimcheck.load(tmp_path, claim) == b"payload" * 1000
    (tmp_path / claim.path).write_bytes(b"x" * claim.size)
    with pytest.raises(ClaimCheckError, match="sha256"):
        claimcheck.load(tmp_path, claim)
    (tmp_path / claim.path).unlink()
    with pytest.raises(ClaimCheckError, match="missing"):
        claimcheck.load(tmp_path, claim)


def test_server_config_sets_payload_store_and_auth(tmp_path):
    server = NatsServer(
        tmp_path, port=4999, http_port=8999, max_payload_mb=8, token="t", sync_always=True
    )
    config = json.loads(server.config_text())
    assert config["max_payload"] == 8 * 1024 * 1024
    assert config["jetstream"] == {
        "store_dir": str(tmp_path / "jetstream"),
        "sync_interval": "always",
    }
    assert config["authorization"] == {"token": "t"}
    assert server.url == "nats://127.0.0.1:4999"


def test_bus_config_rejects_inconsistent_fields():
    with pytest.raises(ValueError, match="duplicate_window_s"):
        BusConfig(stream_max_age_s=60)
    with pytest.raises(ValueError, match="bus.user"):
        BusConfig(password_file="pw")
    with pytest.raises(ValueError, match="tls_cert"):
        BusConfig(tls_key="k.pem")


def test_nak_backoff_doubles_per_delivery_and_is_capped():
    from rlbus.bus.consumer import MAX_NAK_DELAY_S, nak_delay

    assert [nak_delay(1.0, n) for n in (1, 2, 3, 4)] == [1.0, 2.0, 4.0, 8.0]
    assert nak_delay(1.0, 50) == MAX_NAK_DELAY_S


def test_max_deliver_must_be_at_least_one():
    assert BusConfig().max_deliver == 5
    with pytest.raises(ValueError, match="max_deliver"):
        BusConfig(max_deliver=0)


def test_dead_letter_kinds_follow_the_stream_or_bucket():
    from rlbus.wire.subjects import RunSubjects

    s = RunSubjects("r")
    kinds = [s.dead_kind(name) for name in (s.rollouts_stream, s.batches_stream, s.tasks_stream)]
    assert kinds == ["rollout", "batch", "task"]
    assert s.dead_kind(s.weights_bucket) == "weights-record"
    assert s.dead_kind(s.replicas_bucket) == "replica-entry"


class StuckSubscription:
    """A subscription whose UNSUB is never flushed, or whose connection is already closed."""

    def __init__(self, error: Exception | None = None):
        self.error = error
        self.calls = 0

    async def unsubscribe(self):
        self.calls += 1
        if self.error is not None:
            raise self.error
        await asyncio.sleep(3600)


async def test_unsubscribing_at_shutdown_neither_raises_nor_hangs(monkeypatch):
    from rlbus.bus import core

    monkeypatch.setattr(core, "UNSUBSCRIBE_TIMEOUT_S", 0.05)
    closed, stuck = (
        StuckSubscription(ConnectionError("nats: connection closed")),
        StuckSubscription(),
    )
    await asyncio.wait_for(core.unsubscribe_quietly(closed), 2)
    await asyncio.wait_for(core.unsubscribe_quietly(stuck), 2)
    assert closed.calls == stuck.calls == 1
