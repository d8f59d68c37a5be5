"""A typed snapshot of one stream and its durable consumers (`Bus.stream_stats`).

The orchestrator's Prometheus gauges (`rlbus.obs.metrics.refresh_stream_stats`) and anyone who
wants queue depth or consumer lag read it here instead of reaching into nats-py's JetStream API.
"""

from dataclasses import dataclass

from nats.js import JetStreamContext


@dataclass(frozen=True)
class ConsumerStats:
    """One durable consumer of a stream, as the server counts it now."""

    durable: str
    num_pending: int
    """Messages stored after the consumer's position: not yet delivered."""
    num_ack_pending: int
    """Messages delivered and not yet acknowledged."""


@dataclass(frozen=True)
class StreamStats:
    """One stream: how many messages it holds and how far behind its durable consumers are."""

    stream: str
    num_messages: int
    first_seq: int
    last_seq: int
    consumers: tuple[ConsumerStats, ...]
    """Durable consumers only (an ephemeral one, e.g. nats-py's `kv.keys()`, is left out)."""


async def read_stream_stats(js: JetStreamContext, stream: str) -> StreamStats:
    """`stream`'s snapshot: one STREAM.INFO and one CONSUMER.LIST request."""
    state = (await js.stream_info(stream)).state
    found = await js.consumers_info(stream)
    consumers = tuple(
        ConsumerStats(
            durable=info.config.durable_name,
            num_pending=info.num_pending or 0,
            num_ack_pending=info.num_ack_pending or 0,
        )
        for info in found
        if info.config.durable_name
    )
    return StreamStats(stream, state.messages, state.first_seq, state.last_seq, consumers)
