"""The run's JetStream topology: what `BusCore.ensure` creates (or updates) on the server.

Every stream keeps its messages in files, allows direct gets (how the step log, KV reads and
outside readers fetch a message without a consumer) and deduplicates by `Nats-Msg-Id` within
`bus.duplicate_window_s`. Each call is idempotent: it creates the object, or updates it to
today's settings.
"""

import nats.js.errors
import structlog
from nats.js import JetStreamContext, api

from rlbus.configs.bus import BusConfig
from rlbus.wire.subjects import BucketSpec, ConsumerSpec, StreamSpec

log = structlog.get_logger()

STREAM_NAME_IN_USE = 10058
"""JetStream error code of an `add_stream` whose name exists with another config."""


def stream_config(spec: StreamSpec, config: BusConfig) -> api.StreamConfig:
    """The server-side config of stream `spec` under the run's bus settings."""
    retention = (
        api.RetentionPolicy.WORK_QUEUE
        if spec.retention == "workqueue"
        else api.RetentionPolicy.LIMITS
    )
    return api.StreamConfig(
        name=spec.name,
        subjects=list(spec.subjects),
        retention=retention,
        storage=api.StorageType.FILE,
        max_age=config.stream_max_age_s,
        max_bytes=config.stream_max_bytes,
        max_msgs_per_subject=spec.max_msgs_per_subject,
        max_msg_size=-1,
        duplicate_window=config.duplicate_window_s,
        allow_direct=True,
    )


async def ensure_stream(js: JetStreamContext, spec: StreamSpec, config: BusConfig) -> None:
    """Create stream `spec`, or update it when it exists with another config."""
    stream = stream_config(spec, config)
    try:
        await js.add_stream(stream)
    except nats.js.errors.BadRequestError as error:
        if error.err_code != STREAM_NAME_IN_USE:
            raise
        await js.update_stream(stream)
        log.info("stream_updated", stream=spec.name)


async def ensure_consumer(js: JetStreamContext, spec: ConsumerSpec, config: BusConfig) -> None:
    """Create the durable, or update it to today's settings (e.g. a changed `ack_wait_s`).

    JetStream's own `max_deliver` is unlimited on purpose: the bound is the consumer's
    (`bus.max_deliver` deliveries whose handler raised, then a dead letter with the error).
    A JetStream limit would count the deliveries a handler defers with `nak()` too (a
    rollout worker naks its tasks while no replica is up) and then drop the message
    silently, with no dead letter: data loss."""
    consumer = api.ConsumerConfig(
        durable_name=spec.durable,
        name=spec.durable,
        ack_policy=api.AckPolicy.EXPLICIT,
        ack_wait=config.ack_wait_s,
        max_deliver=-1,
        max_ack_pending=config.max_ack_pending,
        filter_subject=spec.filter_subject,
        deliver_policy=api.DeliverPolicy.ALL,
    )
    await js.add_consumer(spec.stream, consumer)


async def ensure_bucket(js: JetStreamContext, spec: BucketSpec) -> None:
    """Create KV bucket `spec` (file storage, direct gets; an existing one is left as it is)."""
    await js.create_key_value(
        api.KeyValueConfig(
            bucket=spec.name, history=spec.history, direct=True, storage=api.StorageType.FILE
        )
    )
