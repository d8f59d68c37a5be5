"""Wire messages of rlbus: every payload that crosses the NATS bus.

One module per message family, each a set of `msgspec.Struct`s plus a module-level `encoder` and
`decoder` built once (msgpack). Rules that keep replays of old JetStream messages readable:

- every struct is `kw_only=True`; new fields get a default and go last;
- decoders ignore unknown fields (msgspec's default), so an older service reads a newer message;
- hot, large payloads (`MicroBatch`, `RolloutSample`) are `array_like=True` (positional msgpack
  arrays, no repeated key names); control-plane messages stay maps.

`subjects.py` names every subject, stream, durable consumer and KV bucket of a run. The bus layer
(`rlbus.bus`) moves the encoded bytes; it never needs to know which struct they hold.
"""

from rlbus.wire import (
    batches,
    claims,
    control,
    events,
    replicas,
    rollouts,
    run,
    subjects,
    tasks,
    weights,
)
from rlbus.wire.subjects import RunSubjects

__all__ = [
    "RunSubjects",
    "batches",
    "claims",
    "control",
    "events",
    "replicas",
    "rollouts",
    "run",
    "subjects",
    "tasks",
    "weights",
]
