"""The NATS JetStream layer: the only code in rlbus that touches nats-py.

- `BusCore` (core.py): ensure topology, publish / publish_many (msg id, trace headers, claim
  check, retries), payload decoding, dead letters. Imports none of the modules below. Built on
  topology.py (stream, durable and bucket configs), claimcheck.py (claim-check files) and
  quarantine.py (dead-letter headers and records).
- `Bus` (client.py): a `BusCore` plus connect, consumers, live subscriptions, step log, KV,
  leases, control request/reply (control.py), the replica registry and the run's end
  (records.py) and `stream_stats` (stats.py: `StreamStats`, `ConsumerStats`).
- `Consumer` / `Delivery` (consumer.py): pull-consume runner with ack/nak/term/in_progress.
- `StepLog` (steplog.py): train batches keyed by step.
- `KV` / `Lease` (kv.py): bucket wrappers and TTL leases with heartbeats; kvwatch.py keeps a
  watch going through NATS outages.

The embedded nats-server (`rlbus-nats`) is not here: it is a tool that runs the bus, in
`rlbus_launch.natsserver`.

See docs/bus.md for usage. `Subscription` (what `Bus.subscribe` returns) is nats-py's, re-exported
so that code outside the bus can name it without importing nats-py.
"""

from nats.aio.subscription import Subscription

from rlbus.bus.client import Bus
from rlbus.bus.consumer import Consumer, Delivery
from rlbus.bus.core import BusCore, encode, unsubscribe_quietly
from rlbus.bus.errors import (
    BusAuthError,
    BusConnectError,
    BusError,
    CasMismatch,
    ClaimCheckError,
    LeaseHeld,
    StepNotFound,
)
from rlbus.bus.kv import KV, Entry, Lease
from rlbus.bus.stats import ConsumerStats, StreamStats
from rlbus.bus.steplog import StepLog

__all__ = [
    "KV",
    "Bus",
    "BusCore",
    "BusAuthError",
    "BusConnectError",
    "BusError",
    "CasMismatch",
    "ClaimCheckError",
    "ConsumerStats",
    "Consumer",
    "Delivery",
    "Entry",
    "Lease",
    "LeaseHeld",
    "StepLog",
    "StepNotFound",
    "StreamStats",
    "Subscription",
    "encode",
    "unsubscribe_quietly",
]
