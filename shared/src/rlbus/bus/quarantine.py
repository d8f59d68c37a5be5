"""Dead letters: the headers a quarantined message carries, its id, and reading them back.

`BusCore.dead_letter` copies a message no one can use to `subjects.dead(stream)` (stream
`RLBUS_<run>_DEAD`), payload unchanged, with the `Rlbus-Dead-*` headers below; `BusCore.dead_letters`
lists them (docs/bus.md, "Dead letters"; `rl dead-letters` prints them).
"""

import msgspec
import nats.js.errors
from nats.js import JetStreamContext, api

from rlbus.bus import claimcheck

# Headers of a dead letter (docs/bus.md, "Dead letters"); the payload is the original message's.
DEAD_REASON = "Rlbus-Dead-Reason"
DEAD_SUBJECT = "Rlbus-Dead-Subject"
DEAD_STREAM = "Rlbus-Dead-Stream"
DEAD_KIND = "Rlbus-Dead-Kind"
DEAD_ORIGIN = "Rlbus-Dead-Origin"
DEAD_NUM_DELIVERED = "Rlbus-Dead-Num-Delivered"
DEAD_STREAM_SEQ = "Rlbus-Dead-Stream-Seq"
DEAD_MSG_ID = "Rlbus-Dead-Msg-Id"
DEAD_REASON_MAX_CHARS = 1000


class DeadLetter(msgspec.Struct, frozen=True):
    """One quarantined message as `BusCore.dead_letters()` lists it (payload left out)."""

    seq: int
    """Sequence in the run's dead-letter stream."""
    time: float
    """When it was quarantined (Unix seconds, the server's clock)."""
    kind: str
    stream: str
    subject: str
    origin: str
    """`<bus client name>@<host>:<pid>` of the process that quarantined it."""
    reason: str
    num_delivered: int | None = None
    stream_seq: int | None = None
    """Sequence (or KV revision) of the original message, when known."""
    msg_id: str | None = None
    """Nats-Msg-Id of the original message, when it had one."""

    @classmethod
    def from_message(cls, msg: api.RawStreamMsg) -> "DeadLetter":
        """The record of one message of the dead-letter stream."""
        headers = msg.headers or {}

        def number(name: str) -> int | None:
            value = headers.get(name)
            return int(value) if value and value.isdigit() else None

        return cls(
            seq=msg.seq or 0,
            time=msg.time.timestamp() if msg.time else 0.0,
            kind=headers.get(DEAD_KIND, "-"),
            stream=headers.get(DEAD_STREAM, "-"),
            subject=headers.get(DEAD_SUBJECT, msg.subject or "-"),
            origin=headers.get(DEAD_ORIGIN, "-"),
            reason=headers.get(DEAD_REASON, "-"),
            num_delivered=number(DEAD_NUM_DELIVERED),
            stream_seq=number(DEAD_STREAM_SEQ),
            msg_id=headers.get(DEAD_MSG_ID),
        )


def dead_letter_id(
    kind: str, original_id: str | None, stream_seq: int | None, fallback: str
) -> str:
    """The dead letter's Nats-Msg-Id: `dead-<original msg id>`, else `dead-<kind>-<stream_seq>`,
    else `dead-<fallback>` (random): the same message quarantined twice is stored once."""
    if original_id:
        return f"dead-{original_id}"
    if stream_seq is not None:
        return f"dead-{kind}-{stream_seq}"
    return f"dead-{fallback}"


def dead_letter_headers(
    *,
    stream: str,
    subject: str,
    kind: str,
    origin: str,
    reason: str,
    original: dict[str, str] | None,
    original_id: str | None,
    num_delivered: int | None,
    stream_seq: int | None,
) -> dict[str, str]:
    """The `Rlbus-Dead-*` headers of a dead letter (the claim-check header kept when the
    original carried one: the payload is still the reference)."""
    headers = {
        DEAD_REASON: reason[:DEAD_REASON_MAX_CHARS],
        DEAD_SUBJECT: subject,
        DEAD_STREAM: stream,
        DEAD_KIND: kind,
        DEAD_ORIGIN: origin,
    }
    if num_delivered is not None:
        headers[DEAD_NUM_DELIVERED] = str(num_delivered)
    if stream_seq is not None:
        headers[DEAD_STREAM_SEQ] = str(stream_seq)
    if original_id:
        headers[DEAD_MSG_ID] = original_id
    if original and original.get(claimcheck.CLAIM_HEADER):
        headers[claimcheck.CLAIM_HEADER] = "1"
    return headers


async def read_dead_letters(
    js: JetStreamContext, stream: str, *, limit: int | None
) -> list[DeadLetter]:
    """The dead letters in `stream`, oldest first (at most `limit`, the newest ones); none when
    the run never quarantined anything (no dead-letter stream yet)."""
    try:
        state = (await js.stream_info(stream)).state
    except nats.js.errors.NotFoundError:
        return []
    seq = state.first_seq
    if limit is not None:
        seq = max(seq, state.last_seq - limit + 1)
    letters = []
    while seq <= state.last_seq:
        try:
            msg = await js.get_msg(stream, seq, next=True)
        except nats.js.errors.NotFoundError:
            break
        letters.append(DeadLetter.from_message(msg))
        seq = (msg.seq or seq) + 1
    return letters
