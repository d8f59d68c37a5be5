"""Run state: the record that says a run is finished, and who coordinates it.

- `RunFinished`: sender trainer rank 0, once it trained its last step (`max_steps`); stored in the
  KV bucket `subjects.state_bucket` under key `subjects.RUN_FINISHED_KEY`. The trainer deletes it
  when it starts with steps left (a resumed run with a higher `max_steps`). Receivers: services
  started with `--exit-when-finished` (inference, rollout workers, the monitor, `rlbus-nats`),
  which then drain and exit 0, so that a compose stack or a SLURM job ends by itself.
- `CoordinatorLeader`: the value of the coordinator's leader lease (TTL key
  `subjects.COORDINATOR_LEADER_KEY` of the state bucket); sender the coordinator that holds it,
  receivers the standby coordinators (to recognise a lease left by a dead process on their host).
"""

import msgspec

from rlbus.wire.base import Message, now


class RunFinished(Message, kw_only=True, tag="run_finished"):
    """The trainer trained every step of the run."""

    last_step: int
    """The run's last trained step (its `max_steps`)."""

    time: float = msgspec.field(default_factory=now)


class CoordinatorLeader(Message, kw_only=True, tag="coordinator_leader"):
    """The process that coordinates the run now."""

    host: str
    pid: int
    since: float = msgspec.field(default_factory=now)


encoder = msgspec.msgpack.Encoder()
decoder = msgspec.msgpack.Decoder(RunFinished)
leader_decoder = msgspec.msgpack.Decoder(CoordinatorLeader)
