"""The bus contract in a form a client in another language can be written from.

`REGISTRY` lists every top-level message of the bus (each `Message` subclass of `rlbus.wire`, plus
the bus's own `ClaimCheck`) with the routes it travels on: subject (with `<prefix>`, `<step>`, ...
placeholders), stream or KV bucket and key, retention, sender -> receivers, message id and
headers, and a small example. From it this module generates two checked-in files:

- docs/bus-schema.json: msgspec's JSON Schema of every struct under `$defs`, plus per message its
  tag, routes, encoding and fields in encoding order (with defaults and field docstrings), an
  index from subject pattern to the messages that travel on it, and the placeholders, headers,
  claim-check and dead-letter conventions;
- docs/bus-messages.md: the same for people, one section per message.

    ./uvw run python -m rlbus_launch.schema --write   # regenerate both after changing a wire struct
    ./uvw run python -m rlbus_launch.schema --check   # exit 1 naming a stale file (tests run it)

Names of subjects, streams, durables and buckets come from `RunSubjects` of a placeholder run,
header names from `rlbus.bus`, so the documents follow the code. (This is the one module of
`rlbus.wire` that reads the bus layer, and only for those names.) Fields are listed in msgspec's
encoding order: declaration order, with a tagged struct's tag field first.
"""

import argparse
import ast
import inspect
import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import msgspec
import msgspec.inspect as mi

from rlbus.bus.claimcheck import CLAIM_HEADER, CLAIMS_DIR
from rlbus.bus.core import CLAIM_CHECK_MARGIN, MSG_ID_HEADER
from rlbus.bus.kv import EXPECTED_LAST_SUBJECT_SEQ
from rlbus.bus.quarantine import (
    DEAD_KIND,
    DEAD_MSG_ID,
    DEAD_NUM_DELIVERED,
    DEAD_ORIGIN,
    DEAD_REASON,
    DEAD_STREAM,
    DEAD_STREAM_SEQ,
    DEAD_SUBJECT,
)
from rlbus.docstrings import attribute_docstrings
from rlbus.wire import batches, claims, control, events, replicas, rollouts, run, tasks, weights
from rlbus.wire.subjects import (
    COORDINATOR_LEADER_KEY,
    PREFIX,
    RUN_FINISHED_KEY,
    WEIGHTS_LATEST_KEY,
    RunSubjects,
)

ROOT = Path(__file__).resolve().parents[3]
DOCS_DIR = ROOT / "docs"
JSON_NAME = "bus-schema.json"
MARKDOWN_NAME = "bus-messages.md"
REGENERATE = "./uvw run python -m rlbus_launch.schema --write"

# ---- names of a placeholder run ---------------------------------------------------------------

_RUN = "__run__"
"""A run id that survives `sanitize_run_id`; replaced by `<run>` in every documented name."""
_S = RunSubjects(_RUN)


def pattern(name: str) -> str:
    """A subject, stream or bucket name of the placeholder run, with `<prefix>` / `<run>`."""
    return name.replace(_S.prefix, "<prefix>").replace(_RUN, "<run>")


PLACEHOLDERS = {
    "<prefix>": {
        "value": f"{PREFIX}.<run>",
        "description": "Root of every subject of a run.",
    },
    "<run>": {
        "pattern": "[A-Za-z0-9_-]+",
        "description": "The run id, sanitized: each character outside [A-Za-z0-9_-] becomes `_`.",
    },
    "<step>": {"pattern": "[0-9]+", "description": "A training step, in decimal."},
    "<service>": {
        "pattern": "[A-Za-z0-9_-]+",
        "description": "A service name: `orchestrator`, `trainer`, `inference`.",
    },
    "<replica_id>": {
        "pattern": "[-/_=.A-Za-z0-9]+",
        "description": "An inference replica's id (a KV key).",
    },
    "<stream>": {
        "pattern": "[A-Za-z0-9_-]+",
        "description": "Name of the stream or KV bucket a dead letter came from.",
    },
}

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
NATS_TTL = "Nats-TTL"
"""Set by nats-py for a per-message TTL (`msg_ttl`); nats.js.api.Header.MSG_TTL."""

HEADERS = {
    MSG_ID_HEADER: "JetStream deduplication id; each route says how it is derived (random when "
    "not). A retried publish keeps it, so a retry is never stored twice.",
    TRACEPARENT: "W3C trace context of the producer span; only when the sender records traces.",
    TRACESTATE: "W3C trace state, with `traceparent` when the tracer has any.",
    CLAIM_HEADER: "`1` when the payload is a `ClaimCheck` that stands for the real payload "
    "(see claim_check).",
    NATS_TTL: "Per-key TTL of a lease, in seconds; the holder republishes the value every "
    "TTL/3 (heartbeat) and deletes the key when it lets go.",
    EXPECTED_LAST_SUBJECT_SEQ: "Compare-and-set: the write is stored only if the key's last "
    "revision is this one (`0`: the key must be absent).",
}
STREAM_HEADERS = (MSG_ID_HEADER, TRACEPARENT, TRACESTATE, CLAIM_HEADER)
"""Headers of every JetStream publish (`BusCore.publish`)."""
LEASE_HEADERS = (NATS_TTL, EXPECTED_LAST_SUBJECT_SEQ)
CONTROL_HEADERS = (TRACEPARENT, TRACESTATE)

ENCODING = {
    "format": "msgpack, written by msgspec; a float is a float64, an int the smallest int type",
    "maps": "A struct is a msgpack map whose keys are its field names in the documented order "
    "(declaration order). Every field is written, defaults included.",
    "tags": "In a tagged union the tag field (`type`) comes first in the map; its value names "
    "the struct. A subject that carries several structs is decoded by that tag.",
    "arrays": "An `array_like` struct (MicroBatch, RolloutSample: hot token lists) is a msgpack "
    "array of its field values in the documented order, no keys.",
    "evolution": "New fields get a default and go last. Receivers ignore unknown map keys and "
    "extra trailing array elements, and fill absent fields with their defaults, because "
    "JetStream replays old messages.",
    "validation": "Types carry their ranges (`int >= 0`, a bare file name, ...); a message out "
    "of range fails to decode and is quarantined (see dead_letters).",
}

CLAIM_CHECK = {
    "header": CLAIM_HEADER,
    "value": "1",
    "message": "ClaimCheck",
    "applies_to": "JetStream publishes only (not KV entries, not control)",
    "threshold": "A payload above the publisher's `bus.claim_check_bytes` (default: the "
    f"server's max_payload - {CLAIM_CHECK_MARGIN // 1024} KiB) is written to the run's shared "
    "storage and the message carries a ClaimCheck instead.",
    "file": f"`<storage_dir>/<path>`: `path` is relative, under `{CLAIMS_DIR}/`, without `..`; "
    "the file has exactly `size` bytes and their sha256 is `sha256` (hex). Its bytes are the "
    "real payload, encoded as the subject's message.",
}

DEAD_HEADERS = {
    DEAD_REASON: "The decode error or the handler's error (at most 1000 characters).",
    DEAD_SUBJECT: "Where the message was (a KV entry: `$KV.<bucket>.<key>`).",
    DEAD_STREAM: "The stream or KV bucket it was in.",
    DEAD_KIND: "`task`, `rollout`, `batch`, `event`, `weights-record`, `replica-entry`, "
    "`state-entry`, ...",
    DEAD_ORIGIN: "`<bus client name>@<host>:<pid>` of the process that quarantined it.",
    DEAD_NUM_DELIVERED: "Delivery count, when known.",
    DEAD_STREAM_SEQ: "Stream sequence or KV revision of the original, when known.",
    DEAD_MSG_ID: "The original `Nats-Msg-Id`, when it had one.",
    MSG_ID_HEADER: "`dead-<original msg id>`, else `dead-<kind>-<seq or revision>`.",
    CLAIM_HEADER: "Kept when the original was a claim check (its file is kept too).",
}

OTHER_ENTRIES = [
    {
        "bucket": pattern(_S.state_bucket),
        "key": "orchestrator",
        "encoding": "JSON (not msgpack)",
        "description": "The coordinator's own restart state "
        "(`rlbus_orchestrator.state_store.CoordinatorState`): private to the coordinator, not a "
        "wire message, so not described here.",
    },
]


JSON_SCHEMA_DRAFT = "https://json-schema.org/draft/2020-12/schema"
"""The draft `$defs` are written in (`prefixItems` for array_like structs): a draft-07 validator
would accept anything there."""

BUCKET_KEYS = {
    pattern(_S.state_bucket): {
        RUN_FINISHED_KEY: "RunFinished",
        COORDINATOR_LEADER_KEY: "CoordinatorLeader (a TTL lease)",
        "orchestrator": "JSON, private to the coordinator (see other_entries)",
    },
    pattern(_S.weights_bucket): {WEIGHTS_LATEST_KEY: "WeightsPublished"},
    pattern(_S.replicas_bucket): {"<replica_id>": "ReplicaInfo (a TTL lease per replica)"},
}
"""Every key each KV bucket of a run can hold: no other key is written."""

READING = {
    "bus_file": "`<run_dir>/configs/bus.json`, written by `rl` when it plans a run (`--dry-run` "
    "too): `url` (the NATS URL), `run` (the `<run>` of every name), `prefix`, `storage_dir` "
    "(claim-check root), `server_config` (the embedded nats-server's config, "
    "`<run_dir>/configs/nats.conf`, JSON; null for a bus `rl` did not start) and `credentials` "
    "(paths of the credential files the services use: `token_file`, `user` + `password_file`, "
    "`creds_file`, `nkey_seed_file`, `tls_ca`, `tls_cert`, `tls_key`; only those set).",
    "validate": f'Validate message `<Name>` against `{{"$schema": "{JSON_SCHEMA_DRAFT}", '
    '"$defs": <$defs>, "$ref": "#/$defs/<Name>"}`.',
    "streams": "Read-only, work queues included: `$JS.API.STREAM.INFO.<stream>` gives "
    "`state.first_seq` / `last_seq`; `$JS.API.DIRECT.GET.<stream>` with "
    '`{"seq": n, "next_by_subj": ">"}` returns the first message stored at or after `n` '
    "(headers `Nats-Subject`, `Nats-Sequence`; status 404: none). Never create a consumer on "
    "`tasks` or `rollouts`: a work-queue stream hands each message to one consumer (the server "
    "refuses an ordered consumer there), so an observer would take work. A work queue removes "
    "a message once acked: poll to watch it, and a message acked between two polls is not seen.",
    "kv": "Read-only: `$JS.API.STREAM.INFO.KV_<bucket>` with "
    '`{"subjects_filter": "$KV.<bucket>.>"}` lists the keys (`state.subjects`); '
    "`$JS.API.DIRECT.GET.KV_<bucket>.$KV.<bucket>.<key>` returns a key's last entry. Skip "
    "entries with header `KV-Operation` `DEL` or `PURGE` and empty ones (an expired lease).",
    "permissions": "On a secured bus read as the `monitor` role: it may use the JetStream API "
    "(direct gets included) and publish nothing else of the run.",
}
"""How an outside client finds a run's bus and reads it without taking work."""


# ---- routes -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Route:
    """One way a message travels: where it is written, how it is kept, who reads it."""

    transport: Literal["jetstream", "kv", "request", "reply"]
    subject: str
    """Subject pattern (a KV entry's subject is `$KV.<bucket>.<key>`; a reply's: the request's)."""
    sender: str
    receivers: str
    retention: str
    read_by: str
    stream: str | None = None
    """JetStream stream (for a KV entry: the bucket's stream `KV_<bucket>`); None for core NATS."""
    bucket: str | None = None
    key: str | None = None
    msg_id: str | None = None
    """Pattern of the `Nats-Msg-Id` (None: random); `<task_id>` is the message's field."""
    headers: tuple[str, ...] = ()


def nats_subject_matches(filter_subject: str, subject: str) -> bool:
    """Whether `subject` matches a NATS filter (`*` one token, `>` the rest)."""
    wanted, tokens = filter_subject.split("."), subject.split(".")
    for index, token in enumerate(wanted):
        if token == ">":
            return len(tokens) > index
        if index >= len(tokens) or token not in ("*", tokens[index]):
            return False
    return len(tokens) == len(wanted)


def stream_route(
    subject: str, *, sender: str, receivers: str, read_by: str, msg_id: str | None = None
) -> Route:
    """A JetStream publish to `subject`, with the stream and retention `RunSubjects` gives it."""
    (spec,) = [s for s in _S.streams() if any(nats_subject_matches(f, subject) for f in s.subjects)]
    retention = "work-queue" if spec.retention == "workqueue" else "limits"
    if spec.max_msgs_per_subject > 0:
        retention += f", at most {spec.max_msgs_per_subject} message per subject"
    return Route(
        "jetstream",
        pattern(subject),
        sender,
        receivers,
        retention,
        read_by,
        stream=pattern(spec.name),
        msg_id=msg_id,
        headers=STREAM_HEADERS,
    )


def durable_of(stream: str, subject: str | None = None) -> str:
    (spec,) = [
        c for c in _S.consumers() if c.stream == stream and subject in (None, c.filter_subject)
    ]
    return f"durable pull consumer `{spec.durable}` (explicit ack)"


def kv_route(
    bucket: str,
    key: str,
    *,
    sender: str,
    receivers: str,
    read_by: str,
    lease: bool = False,
    headers: tuple[str, ...] = (),
) -> Route:
    """An entry of KV bucket `bucket` (a lease: the key has a TTL and is heartbeated)."""
    (spec,) = [b for b in _S.buckets() if b.name == bucket]
    retention = f"KV, history {spec.history}"
    if lease:
        retention += ", per-key TTL (a lease, heartbeated every TTL/3)"
    return Route(
        "kv",
        pattern(f"$KV.{bucket}.{key}"),
        sender,
        receivers,
        retention,
        read_by,
        stream=pattern(f"KV_{bucket}"),
        bucket=pattern(bucket),
        key=key,
        headers=LEASE_HEADERS if lease else headers,
    )


EVENTS_READ_BY = "ad hoc durable `monitor` on `<prefix>.events.>` (rlbus_launch.monitor)"
CONTROL_SUBJECT = pattern(_S.control("<service>"))
CONTROL_REQUEST = Route(
    "request",
    CONTROL_SUBJECT,
    "the launcher (`rl` drain/stop/pause/resume) or a user tool",
    "the service named by the subject (`rlbus.lifecycle.control_handler`)",
    "not stored",
    "core subscription of the service",
    headers=CONTROL_HEADERS,
)
CONTROL_REPLY = Route(
    "reply",
    CONTROL_SUBJECT,
    "the service that got the request",
    "the requester (on the request's reply inbox)",
    "not stored",
    "the requester's reply inbox",
)
TASKS = stream_route(
    _S.tasks,
    sender="orchestrator coordinator",
    receivers="orchestrator rollout workers",
    read_by=durable_of(_S.tasks_stream, _S.tasks) + ", shared by all rollout workers",
    msg_id="<task_id>",
)
EVAL_TASKS = stream_route(
    _S.eval_tasks,
    sender="orchestrator coordinator (an evaluation's tasks)",
    receivers="orchestrator rollout workers (with a concurrency budget of their own)",
    read_by=durable_of(_S.tasks_stream, _S.eval_tasks) + ", shared by all rollout workers",
    msg_id="<task_id>",
)
ROLLOUTS = stream_route(
    _S.rollouts,
    sender="orchestrator rollout workers",
    receivers="orchestrator coordinator",
    read_by=durable_of(_S.rollouts_stream) + "; acked once the batch holding it is stored",
    msg_id="<task_id>",
)
BATCHES = stream_route(
    _S.batch("<step>"),  # type: ignore[arg-type]  # the placeholder where the step goes
    sender="orchestrator coordinator (once per step)",
    receivers="trainer",
    read_by="direct get of the last message on the step's subject (StepLog)",
    msg_id=_S.batch_msg_id("<step>"),  # type: ignore[arg-type]  # the placeholder
)
WEIGHTS_KV = kv_route(
    _S.weights_bucket,
    WEIGHTS_LATEST_KEY,
    sender="trainer rank 0 (create, then compare-and-set update: versions only go up)",
    receivers="inference weight agents, orchestrator coordinator, trainer (on restart)",
    read_by="KV watch / get",
    headers=(EXPECTED_LAST_SUBJECT_SEQ, TRACEPARENT, TRACESTATE),
)
WEIGHTS_PUBLISHED_EVENT = stream_route(
    _S.weights_published,
    sender="trainer rank 0 (after the KV write)",
    receivers="monitors",
    read_by=EVENTS_READ_BY,
    msg_id="weights-<version>-<transport>",
)
WEIGHTS_APPLIED_EVENT = stream_route(
    _S.weights_applied,
    sender="inference replica weight agents",
    receivers="orchestrator coordinator (live subscription), trainer, monitors",
    read_by=EVENTS_READ_BY + "; live core subscriptions",
    msg_id="applied-<replica_id>-<version>-<unix time ns>",
)
WEIGHTS_FAILED_EVENT = stream_route(
    _S.weights_failed,
    sender="inference replica weight agents; trainer rank 0 (`replica_id` `trainer`: an NCCL "
    "broadcast failed)",
    receivers="orchestrator coordinator (live subscription), monitors",
    read_by=EVENTS_READ_BY + "; live core subscriptions",
)
METRICS_EVENT = stream_route(
    _S.metrics("<service>"),
    sender="orchestrator coordinator, trainer rank 0",
    receivers="monitors (metrics.jsonl, wandb); the trainer reads its own last one on restart",
    read_by=EVENTS_READ_BY + "; direct get of the last message on the subject",
)
EVAL_EVENT = stream_route(
    _S.evals("<service>"),
    sender="orchestrator coordinator (one per evaluation of one environment)",
    receivers="monitors (evals.jsonl, wandb)",
    read_by=EVENTS_READ_BY,
)
LIFECYCLE_EVENT = stream_route(
    _S.lifecycle("<service>"),
    sender="orchestrator, trainer, inference replicas (`instance_id`: the replica id)",
    receivers="monitors (log lines, the launcher's progress view)",
    read_by=EVENTS_READ_BY,
)
REPLICA_KV = kv_route(
    _S.replicas_bucket,
    "<replica_id>",
    sender="each inference replica (its lease)",
    receivers="orchestrator rollout workers and coordinator, trainer, launcher, users",
    read_by="list keys, then get each (`Bus.read_replicas`)",
    lease=True,
)
RUN_FINISHED_KV = kv_route(
    _S.state_bucket,
    RUN_FINISHED_KEY,
    sender="trainer rank 0, after its last step (deleted when a resumed run has steps left)",
    receivers="services started with `--exit-when-finished`, `rlbus-nats`",
    read_by="KV get (polled)",
)
LEADER_KV = kv_route(
    _S.state_bucket,
    COORDINATOR_LEADER_KEY,
    sender="the coordinator that holds the leader lease",
    receivers="standby coordinators",
    read_by="KV get",
    lease=True,
)


# ---- the registry -----------------------------------------------------------------------------


@dataclass(frozen=True)
class MessageSpec:
    """A top-level message: its struct, the routes it travels on, and an example."""

    cls: type[msgspec.Struct]
    routes: tuple[Route, ...]
    example: msgspec.Struct

    @property
    def name(self) -> str:
        return self.cls.__name__


EXAMPLE_TIME = 1767225600.0
"""2026-01-01T00:00:00Z: the examples' timestamps, so the generated files do not change."""
EXAMPLE_SHA256 = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"

_SAMPLE = rollouts.RolloutSample(
    prompt_token_ids=[1, 2, 3],
    completion_token_ids=[4, 5],
    completion_logprobs=[-0.5, -1.25],
    completion_mask=[1, 1],
    reward=0.75,
    reward_components={"lcs": 0.75},
    finish_reason="stop",
    policy_version=2,
    replica_id="replica-0",
    timings={"generate": 0.5},
    temperature=1.0,
)
_TOOL_SAMPLE = rollouts.RolloutSample(
    prompt_token_ids=[1, 2, 3],
    completion_token_ids=[4, 5, 6, 7, 8],
    completion_logprobs=[-0.5, -0.25, 0.0, 0.0, -1.0],
    completion_mask=[1, 1, 0, 0, 1],
    reward=1.0,
    finish_reason="stop",
    policy_version=2,
    num_turns=2,
    num_tool_calls=1,
    stop_reason="done",
    messages=[
        tasks.ChatMessage(
            role="assistant",
            tool_calls=[
                tasks.ToolCall(
                    id="call-0",
                    function=tasks.ToolFunction(name="search", arguments='{"query": "abc"}'),
                )
            ],
        ),
        tasks.ChatMessage(role="tool", content="doc 3: abc", tool_call_id="call-0", name="search"),
        tasks.ChatMessage(role="assistant", content="cba"),
    ],
)
_MICRO_BATCH = batches.MicroBatch(
    input_ids=[1, 2, 3, 4, 5],
    position_ids=[0, 1, 2, 3, 4],
    loss_mask=[0, 0, 0, 1, 1],
    advantages=[0.0, 0.0, 0.0, 0.5, 0.5],
    inference_logprobs=[0.0, 0.0, 0.0, -0.5, -1.25],
    temperatures=[1.0, 1.0, 1.0, 1.0, 1.0],
    seq_lens=[5],
)

REGISTRY: tuple[MessageSpec, ...] = (
    MessageSpec(
        tasks.Task,
        (TASKS, EVAL_TASKS),
        tasks.Task(
            task_id="train-12",
            step=3,
            env_id="reverse-text",
            example_id=12,
            problem=tasks.Problem(
                messages=[tasks.ChatMessage(role="user", content="Reverse: abc")], answer="cba"
            ),
            sampling=tasks.SamplingArgs(temperature=1.0, max_tokens=64),
            group_size=2,
            limits=tasks.EpisodeLimits(max_turns=4, deadline_s=60.0),
            min_policy_version=2,
            created_at=EXAMPLE_TIME,
        ),
    ),
    MessageSpec(
        rollouts.Rollout,
        (ROLLOUTS,),
        rollouts.Rollout(
            task_id="train-12",
            step=3,
            env_id="reverse-text",
            example_id=12,
            samples=[_SAMPLE, _TOOL_SAMPLE],
            worker_id="worker-0",
            dropped={"error": 1},
            finished_at=EXAMPLE_TIME,
        ),
    ),
    MessageSpec(
        batches.TrainBatch,
        (BATCHES,),
        batches.TrainBatch(
            step=3,
            micro_batches=[[_MICRO_BATCH]],
            num_samples=1,
            num_tokens=5,
            min_policy_version=2,
            max_policy_version=2,
            task_ids=["train-12"],
            metrics={"reward/mean": 0.75},
            created_at=EXAMPLE_TIME,
        ),
    ),
    MessageSpec(
        weights.WeightsPublished,
        (WEIGHTS_KV, WEIGHTS_PUBLISHED_EVENT),
        weights.WeightsPublished(
            version=3,
            transport="filesystem",
            location="/runs/my-run/broadcasts/step_3",
            files=[weights.WeightFile(name="model.safetensors", size=1024, sha256=EXAMPLE_SHA256)],
            dtype="bfloat16",
            published_at=EXAMPLE_TIME,
        ),
    ),
    MessageSpec(
        weights.WeightsApplied,
        (WEIGHTS_APPLIED_EVENT,),
        weights.WeightsApplied(
            version=3, replica_id="replica-0", duration_s=1.5, applied_at=EXAMPLE_TIME
        ),
    ),
    MessageSpec(
        weights.WeightsFailed,
        (WEIGHTS_FAILED_EVENT,),
        weights.WeightsFailed(
            version=3, replica_id="replica-0", reason="checksum mismatch", failed_at=EXAMPLE_TIME
        ),
    ),
    MessageSpec(
        events.StepMetrics,
        (METRICS_EVENT,),
        events.StepMetrics(service="trainer", step=3, metrics={"loss": 0.25}, time=EXAMPLE_TIME),
    ),
    MessageSpec(
        events.EvalResult,
        (EVAL_EVENT,),
        events.EvalResult(
            service="orchestrator",
            step=10,
            env="reverse-text",
            metrics={"eval/reverse-text/reward/mean": 0.5, "eval/reverse-text/pass@1": 0.25},
            time=EXAMPLE_TIME,
        ),
    ),
    MessageSpec(
        events.Lifecycle,
        (LIFECYCLE_EVENT,),
        events.Lifecycle(service="trainer", state="ready", time=EXAMPLE_TIME),
    ),
    MessageSpec(
        replicas.ReplicaInfo,
        (REPLICA_KV,),
        replicas.ReplicaInfo(
            replica_id="replica-0",
            base_url="http://10.0.0.5:8000/v1",
            admin_url="http://10.0.0.5:8000",
            model="Qwen/Qwen3-0.6B",
            weights_version=3,
            capacity=64,
            started_at=EXAMPLE_TIME,
            updated_at=EXAMPLE_TIME,
        ),
    ),
    MessageSpec(
        run.RunFinished, (RUN_FINISHED_KV,), run.RunFinished(last_step=100, time=EXAMPLE_TIME)
    ),
    MessageSpec(
        run.CoordinatorLeader,
        (LEADER_KV,),
        run.CoordinatorLeader(host="node-1", pid=4242, since=EXAMPLE_TIME),
    ),
    MessageSpec(
        control.Drain, (CONTROL_REQUEST,), control.Drain(reason="user", requested_at=EXAMPLE_TIME)
    ),
    MessageSpec(
        control.Stop, (CONTROL_REQUEST,), control.Stop(reason="user", requested_at=EXAMPLE_TIME)
    ),
    MessageSpec(
        control.Pause, (CONTROL_REQUEST,), control.Pause(reason="user", requested_at=EXAMPLE_TIME)
    ),
    MessageSpec(control.Resume, (CONTROL_REQUEST,), control.Resume(requested_at=EXAMPLE_TIME)),
    MessageSpec(
        control.ControlReply,
        (CONTROL_REPLY,),
        control.ControlReply(ok=True, service="orchestrator", state="draining"),
    ),
    MessageSpec(
        claims.ClaimCheck,
        (),  # no subject of its own: see CLAIM_CHECK
        claims.ClaimCheck(
            path=f"{CLAIMS_DIR}/rlbus.my-run.batches.3/{EXAMPLE_SHA256}-0123456789abcdef.bin",
            size=9_000_000,
            sha256=EXAMPLE_SHA256,
        ),
    ),
)


# ---- describing structs -------------------------------------------------------------------------


def field_docstrings(cls: type) -> dict[str, str]:
    """Field name -> the docstring under its declaration (this class and its struct bases)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not issubclass(klass, msgspec.Struct) or klass is msgspec.Struct:
            continue
        node = ast.parse(inspect.getsource(klass).strip()).body[0]
        assert isinstance(node, ast.ClassDef)
        docs.update({k: inspect.cleandoc(v) for k, v in attribute_docstrings(node).items()})
    return docs


def bounds_text(t: mi.IntType | mi.FloatType) -> str:
    parts = [
        f"{op} {value}"
        for op, value in ((">", t.gt), (">=", t.ge), ("<", t.lt), ("<=", t.le))
        if value is not None
    ]
    return f" {' and '.join(parts)}" if parts else ""


def type_text(t: mi.Type) -> str:
    """A language-neutral spelling of a field type (`int >= 0`, `array[str]`, `str | null`)."""
    match t:
        case mi.IntType() | mi.FloatType():
            return ("int" if isinstance(t, mi.IntType) else "float") + bounds_text(t)
        case mi.StrType(pattern=None, max_length=None):
            return "str"
        case mi.StrType():
            return f"str matching `{t.pattern}`, at most {t.max_length} characters"
        case mi.BoolType():
            return "bool"
        case mi.NoneType():
            return "null"
        case mi.AnyType():
            return "any"
        case mi.ListType():
            return f"array[{type_text(t.item_type)}]"
        case mi.DictType():
            return f"map[{type_text(t.key_type)}, {type_text(t.value_type)}]"
        case mi.UnionType():
            return " | ".join(type_text(member) for member in t.types)
        case mi.LiteralType():
            return " | ".join(json.dumps(value) for value in t.values)
        case mi.StructType():
            return t.cls.__name__
    raise TypeError(f"no spelling for {t!r}: teach rlbus_launch.schema.type_text this type")


def default_of(field: mi.Field) -> dict[str, Any]:
    """`{"default": value}`, `{"default_factory": text}`, or nothing for a required field."""
    if field.required:
        return {}
    if field.default is not msgspec.NODEFAULT:
        return {"default": msgspec.to_builtins(field.default)}
    factory = field.default_factory
    if factory in (list, dict):
        return {"default": factory()}
    if isinstance(factory, type) and issubclass(factory, msgspec.Struct):
        return {"default_factory": f"{factory.__name__}() (each of its fields at its default)"}
    summary = (inspect.getdoc(factory) or "").split("\n")[0]
    return {"default_factory": f"{factory.__name__}(): {summary}"}


def struct_info(cls: type[msgspec.Struct]) -> mi.StructType:
    """msgspec's description of the struct `cls` (type_info answers any type)."""
    info = mi.type_info(cls)
    assert isinstance(info, mi.StructType), cls
    return info


def field_rows(cls: type[msgspec.Struct]) -> list[dict[str, Any]]:
    """The fields of `cls` in encoding order (a tag field first) with type, default and doc."""
    info = struct_info(cls)
    rows = []
    if info.tag_field is not None:
        rows.append(
            {
                "name": info.tag_field,
                "type": json.dumps(info.tag),
                "required": True,
                "description": f"Tag: always `{info.tag}` for {cls.__name__}.",
            }
        )
    docs = field_docstrings(cls)
    for field in info.fields:
        row = {"name": field.encode_name, "type": type_text(field.type), "required": field.required}
        row |= default_of(field)
        if field.name in docs:
            row["description"] = docs[field.name]
        rows.append(row)
    return rows


def struct_entry(cls: type[msgspec.Struct]) -> dict[str, Any]:
    """What every struct gets: module, description, schema, tag, encoding and fields."""
    info = struct_info(cls)
    return {
        "module": cls.__module__,
        "description": inspect.cleandoc(cls.__doc__ or ""),
        "schema": {"$ref": f"#/$defs/{cls.__name__}"},
        "tag_field": info.tag_field,
        "tag": info.tag,
        "encoding": "msgpack array (positional)" if info.array_like else "msgpack map",
        "fields": field_rows(cls),
    }


def route_entry(route: Route) -> dict[str, Any]:
    entry = {
        "transport": route.transport,
        "subject": route.subject,
        "stream": route.stream,
        "bucket": route.bucket,
        "key": route.key,
        "retention": route.retention,
        "read_by": route.read_by,
        "sender": route.sender,
        "receivers": route.receivers,
        "msg_id": route.msg_id,
        "headers": list(route.headers),
    }
    return {name: value for name, value in entry.items() if value is not None}


def message_entry(spec: MessageSpec) -> dict[str, Any]:
    return struct_entry(spec.cls) | {
        "routes": [route_entry(route) for route in spec.routes],
        "example": msgspec.to_builtins(spec.example),
    }


def nested_structs(classes: list[type]) -> Iterator[type[msgspec.Struct]]:
    """Every struct class reachable from the fields of `classes` (not `classes` themselves)."""
    seen = set(classes)

    def walk(t: mi.Type) -> Iterator[type[msgspec.Struct]]:
        match t:
            case mi.StructType():
                if t.cls not in seen:
                    seen.add(t.cls)
                    yield t.cls
                for field in t.fields:
                    yield from walk(field.type)
            case mi.ListType():
                yield from walk(t.item_type)
            case mi.DictType():
                yield from walk(t.value_type)
            case mi.UnionType():
                for member in t.types:
                    yield from walk(member)

    for info in mi.multi_type_info(classes):
        yield from walk(info)


def subject_index(registry: tuple[MessageSpec, ...]) -> list[dict[str, Any]]:
    """One entry per (transport, subject pattern): which messages travel there, decoded how."""
    index: dict[tuple[str, str], dict[str, Any]] = {}
    for spec in registry:
        for route in spec.routes:
            entry = index.setdefault(
                (route.transport, route.subject),
                {
                    "transport": route.transport,
                    "subject": route.subject,
                    "stream": route.stream,
                    "bucket": route.bucket,
                    "key": route.key,
                    "messages": [],
                    "tag_field": None,
                },
            )
            entry["messages"].append(spec.name)
            entry["tag_field"] = entry["tag_field"] or struct_info(spec.cls).tag_field
    entries = [
        {name: value for name, value in entry.items() if value is not None or name == "tag_field"}
        for entry in index.values()
    ]
    return sorted(entries, key=lambda entry: (entry["transport"], entry["subject"]))


def build_schema(registry: tuple[MessageSpec, ...] = REGISTRY) -> dict[str, Any]:
    """The machine-readable contract (docs/bus-schema.json). Maps keyed by name are sorted; maps
    keyed by field (JSON Schema `properties`, examples) keep the encoding order on purpose."""
    classes = [spec.cls for spec in registry]
    _, components = msgspec.json.schema_components(classes, ref_template="#/$defs/{name}")
    nested = sorted(nested_structs(classes), key=lambda cls: cls.__name__)
    return {
        "$schema": JSON_SCHEMA_DRAFT,
        "title": "rlbus bus contract",
        "description": "Every message on the bus of one rlbus run: where it travels, how it is "
        "encoded, and its fields in encoding order. Generated from rlbus.wire; prose in "
        "docs/bus.md, tables in docs/bus-messages.md.",
        "generated_by": f"{REGENERATE} (do not edit by hand)",
        "encoding": ENCODING,
        "placeholders": PLACEHOLDERS,
        "headers": dict(sorted(HEADERS.items())),
        "claim_check": CLAIM_CHECK,
        "dead_letters": {
            "subject": pattern(_S.dead("<stream>")),
            "stream": pattern(_S.dead_stream),
            "retention": "limits",
            "sender": "whichever service met an unusable message (consumer, step log, KV reader)",
            "receivers": "the monitor (`dead_letters/total`), `rl dead-letters`",
            "payload": "The original message's bytes, unchanged: decode it as the message of "
            f"the subject in `{DEAD_SUBJECT}`.",
            "headers": dict(sorted(DEAD_HEADERS.items())),
        },
        "reading": READING,
        "bucket_keys": BUCKET_KEYS,
        "other_entries": OTHER_ENTRIES,
        "subjects": subject_index(registry),
        "messages": {
            spec.name: message_entry(spec) for spec in sorted(registry, key=lambda spec: spec.name)
        },
        "structs": {cls.__name__: struct_entry(cls) for cls in nested},
        "$defs": dict(sorted(components.items())),
    }


# ---- markdown ---------------------------------------------------------------------------------


def cell(text: Any) -> str:
    """Text safe in one markdown table cell."""
    return " ".join(str(text).split()).replace("|", "\\|")


def code(text: str) -> str:
    return f"`{text}`"


def required_text(row: dict[str, Any]) -> str:
    if row["required"]:
        return "required"
    if "default" in row:
        return f"default `{json.dumps(row['default'])}`"
    return f"default {row['default_factory']}"


def fields_table(entry: dict[str, Any]) -> list[str]:
    lines = [
        "| # | field | type | required / default | description |",
        "| - | ----- | ---- | ------------------ | ----------- |",
    ]
    for index, row in enumerate(entry["fields"]):
        lines.append(
            f"| {index} | `{row['name']}` | {cell(row['type'])} | {cell(required_text(row))} "
            f"| {cell(row.get('description', ''))} |"
        )
    return lines


def route_lines(route: dict[str, Any]) -> list[str]:
    where = f"stream `{route['stream']}`" if "stream" in route else "core NATS"
    if "bucket" in route:
        where = f"KV bucket `{route['bucket']}`, key `{route['key']}` (stream `{route['stream']}`)"
    what = "reply to a request on" if route["transport"] == "reply" else route["transport"]
    lines = [
        f"- **{what}** `{route['subject']}`: {where}; {route['retention']}",
        f"  - {route['sender']} -> {route['receivers']}",
        f"  - read by: {route['read_by']}",
    ]
    if "msg_id" in route:
        lines.append(f"  - `{MSG_ID_HEADER}`: `{route['msg_id']}`")
    if route["headers"]:
        lines.append(f"  - headers: {', '.join(map(code, route['headers']))}")
    return lines


def struct_section(name: str, entry: dict[str, Any], level: str = "###") -> list[str]:
    lines = [f"{level} `{name}`", "", f"`{entry['module']}`. {entry['description']}", ""]
    if entry["tag_field"] is not None:
        lines += [f"Tag: `{entry['tag_field']}` = `{entry['tag']}`.", ""]
    order = "positions" if entry["encoding"].startswith("msgpack array") else "keys"
    lines += [f"Encoding: {entry['encoding']}, {order} in this order:", ""]
    return lines + fields_table(entry) + [""]


def message_section(name: str, entry: dict[str, Any]) -> list[str]:
    lines = struct_section(name, entry)
    if entry["routes"]:
        lines += ["Routes:", ""] + [line for r in entry["routes"] for line in route_lines(r)]
    else:
        lines += [
            f"Routes: none of its own; it replaces the payload of a JetStream message with "
            f"header `{CLAIM_HEADER}: 1` (see [Claim checks](#claim-checks))."
        ]
    example = example_json(entry["example"])
    return lines + [
        "",
        "Example (as JSON, keys in encoding order):",
        "",
        "```json",
        example,
        "```",
        "",
    ]


def example_json(value: Any) -> str:
    """JSON of an example, one top-level field per line (keys in encoding order)."""
    if not isinstance(value, dict):
        return json.dumps(value, ensure_ascii=False)
    items = [f"  {json.dumps(k)}: {json.dumps(v, ensure_ascii=False)}" for k, v in value.items()]
    return "{\n" + ",\n".join(items) + "\n}"


def dict_table(header: tuple[str, str], rows: dict[str, str]) -> list[str]:
    lines = [f"| {header[0]} | {header[1]} |", "| --- | --- |"]
    return lines + [f"| `{key}` | {cell(value)} |" for key, value in rows.items()]


def render_markdown(schema: dict[str, Any], registry: tuple[MessageSpec, ...] = REGISTRY) -> str:
    """The human-readable contract (docs/bus-messages.md), built from `build_schema()`'s output."""
    placeholders = {
        name: f"`{info['value']}`: {info['description']}"
        if "value" in info
        else f"{info['description']} Pattern `{info['pattern']}`."
        for name, info in schema["placeholders"].items()
    }
    lines = intro_lines(schema, placeholders) + subject_lines(schema)
    lines += ["", "## Messages", ""]
    for spec in registry:
        lines += message_section(spec.name, schema["messages"][spec.name])
    lines += ["## Nested structs", ""]
    for name, entry in schema["structs"].items():
        lines += struct_section(name, entry)
    return "\n".join(lines + closing_lines(schema))


def intro_lines(schema: dict[str, Any], placeholders: dict[str, str]) -> list[str]:
    """The page's head: encoding, how to read a run, placeholders and headers."""
    return [
        "# Bus messages",
        "",
        f"<!-- Generated by `{REGENERATE}` from rlbus.wire; do not edit by hand. -->",
        "",
        "Every message on the bus of one run, where it travels and its fields in encoding order: "
        "enough to write a client in another language. Machine-readable: "
        f"[{JSON_NAME}]({JSON_NAME}) (with the JSON Schema of each struct under `$defs`); "
        "prose and usage: [bus.md](bus.md). Regenerate both files after changing a wire struct "
        f"with `{REGENERATE}` (`--check` tells whether they are stale).",
        "",
        "## Encoding",
        "",
        *[f"- {cell(text)}" for text in schema["encoding"].values()],
        "",
        "## Reading a run",
        "",
        *[f"- **{name}**: {text}" for name, text in schema["reading"].items()],
        "",
        "## Placeholders",
        "",
        *dict_table(("placeholder", "meaning"), placeholders),
        "",
        "## Headers",
        "",
        *dict_table(("header", "meaning"), schema["headers"]),
        "",
    ]


def subject_lines(schema: dict[str, Any]) -> list[str]:
    """The subjects table: transport, subject, stream and the messages on each."""
    lines = [
        "## Subjects",
        "",
        "| transport | subject | stream | messages (by tag) |",
        "| --------- | ------- | ------ | ----------------- |",
    ]
    for entry in schema["subjects"]:
        by = f" (tag `{entry['tag_field']}`)" if entry["tag_field"] else ""
        messages = ", ".join(f"[`{m}`](#{m.lower()})" for m in entry["messages"])
        lines.append(
            f"| {entry['transport']} | `{entry['subject']}` | {code(entry.get('stream', '-'))} "
            f"| {messages}{by} |"
        )
    return lines


def closing_lines(schema: dict[str, Any]) -> list[str]:
    """The page's tail: claim checks, dead letters, KV keys and the entries not described."""
    claim = schema["claim_check"]
    dead = schema["dead_letters"]
    return [
        "## Claim checks",
        "",
        f"Header `{claim['header']}: {claim['value']}`, payload a [`{claim['message']}`]"
        f"(#{claim['message'].lower()}); {claim['applies_to']}. {claim['threshold']} "
        f"File: {claim['file']}",
        "",
        "## Dead letters",
        "",
        f"Subject `{dead['subject']}`, stream `{dead['stream']}` ({dead['retention']}); "
        f"{dead['sender']} -> {dead['receivers']}. {dead['payload']} Headers:",
        "",
        *dict_table(("header", "value"), dead["headers"]),
        "",
        "## KV keys",
        "",
        "Every key each bucket of a run can hold; no other key is written.",
        "",
        "| bucket | key | value |",
        "| ------ | --- | ----- |",
        *[
            f"| `{bucket}` | `{key}` | {value} |"
            for bucket, keys in schema["bucket_keys"].items()
            for key, value in keys.items()
        ],
        "",
        "## Entries not described here",
        "",
        *[
            f"- KV bucket `{e['bucket']}`, key `{e['key']}` ({e['encoding']}): {e['description']}"
            for e in schema["other_entries"]
        ],
        "",
    ]


# ---- files and command line -------------------------------------------------------------------


def generated_files(registry: tuple[MessageSpec, ...] = REGISTRY) -> dict[str, str]:
    """File name -> the text it must hold."""
    schema = build_schema(registry)
    return {
        JSON_NAME: json.dumps(schema, indent=2, ensure_ascii=False) + "\n",
        MARKDOWN_NAME: render_markdown(schema, registry),
    }


def stale_files(docs_dir: Path, registry: tuple[MessageSpec, ...] = REGISTRY) -> list[Path]:
    """The generated files under `docs_dir` that are missing or differ from what the code gives."""
    return [
        docs_dir / name
        for name, text in generated_files(registry).items()
        if not (docs_dir / name).is_file() or (docs_dir / name).read_text() != text
    ]


def shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def main(argv: list[str] | None = None, registry: tuple[MessageSpec, ...] = REGISTRY) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m rlbus_launch.schema",
        description="Generate the bus contract (docs/bus-schema.json, docs/bus-messages.md) "
        "from rlbus.wire. Without --write or --check, print the JSON.",
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="write both files")
    mode.add_argument("--check", action="store_true", help="exit 1 when a file is stale")
    parser.add_argument("--docs-dir", type=Path, default=DOCS_DIR, help="where the files live")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_files(args.docs_dir, registry)
        if stale:
            names = ", ".join(map(shown, stale))
            print(
                f"{names}: stale (the wire messages changed); run `{REGENERATE}`", file=sys.stderr
            )
            return 1
        return 0
    files = generated_files(registry)
    if not args.write:
        sys.stdout.write(files[JSON_NAME])
        return 0
    for name, text in files.items():
        (args.docs_dir / name).write_text(text)
        print(f"wrote {shown(args.docs_dir / name)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
