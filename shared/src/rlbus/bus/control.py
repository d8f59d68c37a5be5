"""Control request/reply over core NATS (`Bus.request`, `Bus.serve_control`).

A request goes to `subjects.control(service)`; the service answers on the request's reply inbox.
Nothing is stored: a request to a service that is not listening is retried until its deadline.
"""

import asyncio
import time
from collections.abc import Awaitable, Callable

import msgspec
import nats.errors
import structlog
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from rlbus.bus.core import BusCore, encode
from rlbus.bus.errors import BusError
from rlbus.obs import tracing
from rlbus.wire import control

log = structlog.get_logger()

UNANSWERED = (
    nats.errors.NoRespondersError,
    nats.errors.ConnectionReconnectingError,
    nats.errors.TimeoutError,
)
"""A request that got no reply yet: the service is not listening yet, or we are reconnecting."""
RETRY_S = 0.1

ControlHandler = Callable[[control.ControlRequest], Awaitable[control.ControlReply]]


async def request(
    bus: BusCore, service: str, message: control.ControlRequest, timeout_s: float
) -> control.ControlReply:
    """Send `message` to `service` and return its reply, retrying unanswered requests until
    `timeout_s`; then the error is raised with a log line naming the service and the wait."""
    headers = tracing.inject_headers({})
    started = time.monotonic()
    deadline = started + timeout_s
    while True:
        try:
            reply = await bus.nc.request(
                bus.subjects.control(service),
                encode(message),
                timeout=max(deadline - time.monotonic(), 0.01),
                headers=headers,
            )
        except UNANSWERED as error:
            if time.monotonic() + RETRY_S > deadline:
                log.warning(
                    "control_request_timeout",
                    service=service,
                    waited_s=round(time.monotonic() - started, 1),
                    error=type(error).__name__,
                )
                raise
            await asyncio.sleep(RETRY_S)
            continue
        return decode_reply(service, reply.data)


def decode_reply(service: str, data: bytes) -> control.ControlReply:
    """The `ControlReply` in `data`; a garbage reply is the replier's bug, raised as `BusError`."""
    try:
        return control.reply_decoder.decode(data)
    except msgspec.DecodeError as error:
        raise BusError(f"the control reply of {service} does not decode: {error}") from None


async def serve(bus: BusCore, service: str, handler: ControlHandler) -> Subscription:
    """Answer control requests for `service` with `handler`; returns the live subscription
    (on the server before this returns)."""

    async def on_request(msg: Msg) -> None:
        try:
            message = control.decoder.decode(msg.data)
        except msgspec.DecodeError as error:
            reply = control.ControlReply(
                ok=False, service=service, message=f"undecodable request: {error}"
            )
        else:
            with tracing.consumer_span("control", headers=msg.headers, subject=msg.subject):
                reply = await handler(message)
        await msg.respond(encode(reply))

    subscription = await bus.nc.subscribe(bus.subjects.control(service), cb=on_request)
    await bus.nc.flush()
    return subscription
