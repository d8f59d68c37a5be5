"""Read a live rlbus run from the outside, knowing only docs/bus-schema.json and docs/bus-messages.md.

    python examples/bus-reader/read_bus.py <run_dir>                 # every stored message, checked
    python examples/bus-reader/read_bus.py <run_dir> --follow 30     # then watch the queues for 30 s

Plain nats-py, msgpack and jsonschema: no rlbus import. Everything it reads is read-only:

- where the bus is: `<run_dir>/configs/bus.json` (url, run, storage_dir, credential files);
- streams, the work queues (tasks, rollouts) included: STREAM.INFO for the sequence range, then
  one direct get per message (`$JS.API.DIRECT.GET.<stream>` with `{"seq": n, "next_by_subj": ">"}`).
  A consumer would take work from a work-queue stream (and the server refuses a second one there);
- KV buckets: STREAM.INFO with a subjects filter lists the keys, a direct get of the last message
  per key reads each (`nats-py`'s `kv.keys()` would create a consumer per call).

Each message is decoded with msgpack (claim checks resolved and verified), matched to its
message by subject and tag, and validated with the schema's own draft (its `$schema`). One JSON
line per message; the exit code is 1 when any message breaks the contract.
"""

import argparse
import asyncio
import hashlib
import json
import re
import ssl
import sys
from pathlib import Path
from typing import Any

import msgpack
import nats
from jsonschema import validators

SCHEMA = Path(__file__).resolve().parents[2] / "docs" / "bus-schema.json"
PLACEHOLDER = re.compile(r"(<[a-z_]+>)")
DELETED = {"DEL", "PURGE"}


class Contract:
    """docs/bus-schema.json, with the run's names filled in."""

    def __init__(self, doc: dict, run: str) -> None:
        self.doc = doc
        self.run = run
        self.validator_class = validators.validator_for(doc)  # the draft named by `$schema`
        self.structs = doc["messages"] | doc["structs"]
        self.routes = [(self.subject_regex(e["subject"]), e) for e in doc["subjects"]]

    def fill(self, pattern: str) -> str:
        prefix = self.doc["placeholders"]["<prefix>"]["value"]
        return pattern.replace("<prefix>", prefix).replace("<run>", self.run)

    def subject_regex(self, pattern: str) -> re.Pattern[str]:
        placeholders = self.doc["placeholders"]
        parts = PLACEHOLDER.split(self.fill(pattern))
        return re.compile(
            "".join(
                f"(?:{placeholders[p]['pattern']})" if p in placeholders else re.escape(p)
                for p in parts
            )
        )

    def names(self, transport: str, key: str) -> list[str]:
        """Streams or buckets of `transport`, filled in (`key`: "stream" or "bucket")."""
        entries = self.doc["subjects"]
        return sorted({self.fill(e[key]) for e in entries if e["transport"] == transport})

    def message_name(self, transport: str, subject: str, value: Any) -> str | None:
        """The message of the contract that `value` read on `subject` is, by subject and tag."""
        for regex, entry in self.routes:
            if entry["transport"] != transport or not regex.fullmatch(subject):
                continue
            if entry["tag_field"] is None:
                return entry["messages"][0]
            tag = value.get(entry["tag_field"]) if isinstance(value, dict) else None
            tagged = [n for n in entry["messages"] if self.doc["messages"][n]["tag"] == tag]
            return tagged[0] if tagged else None
        return None

    def problems(self, name: str, value: Any) -> list[str]:
        schema = {
            "$schema": self.doc["$schema"],
            "$defs": self.doc["$defs"],
            "$ref": f"#/$defs/{name}",
        }
        return [
            f"{name}{''.join(f'[{p!r}]' for p in error.absolute_path)}: {error.message}"
            for error in self.validator_class(schema).iter_errors(value)
        ]

    def private_keys(self, bucket: str) -> set[str]:
        """Keys of `bucket` that the contract names as not described (e.g. JSON state)."""
        return {e["key"] for e in self.doc["other_entries"] if self.fill(e["bucket"]) == bucket}

    def field(self, struct: str, value: Any, name: str) -> Any:
        """Field `name` of a decoded struct, a map or (array_like) a list by documented position."""
        if isinstance(value, dict):
            return value.get(name)
        fields = [row["name"] for row in self.structs[struct]["fields"]]
        return value[fields.index(name)]


def read_bus_file(run_dir: Path) -> dict:
    """`<run_dir>/configs/bus.json`: where the run's bus is and how to log in."""
    return json.loads((run_dir / "configs" / "bus.json").read_text())


async def connect(bus: dict) -> nats.NATS:
    """A connection with the credentials `bus.json` names (files only: never a secret inline)."""
    options: dict[str, Any] = {"servers": [bus["url"]], "name": "bus-reader"}
    credentials = bus.get("credentials") or {}
    if credentials.get("token_file"):
        options["token"] = Path(credentials["token_file"]).read_text().strip()
    if credentials.get("user"):
        options["user"] = credentials["user"]
        options["password"] = Path(credentials["password_file"]).read_text().strip()
    if credentials.get("tls_ca"):
        options["tls"] = ssl.create_default_context(cafile=credentials["tls_ca"])
    return await nats.connect(**options)


def decode(
    contract: Contract, storage_dir: Path, data: bytes, headers: dict
) -> tuple[Any, list[str]]:
    """The payload of a stored message (a claim check resolved and verified), and any problems."""
    claim_check = contract.doc["claim_check"]
    if headers.get(claim_check["header"]) != claim_check["value"]:
        return msgpack.unpackb(data), []
    claim = msgpack.unpackb(data)
    problems = contract.problems(claim_check["message"], claim)
    path = Path(claim["path"])
    if path.is_absolute() or ".." in path.parts:
        return None, problems + [f"claim path {claim['path']!r} leaves the storage dir"]
    payload = (storage_dir / path).read_bytes()
    if len(payload) != claim["size"] or hashlib.sha256(payload).hexdigest() != claim["sha256"]:
        problems.append(f"claim file {claim['path']} has the wrong size or sha256")
    return msgpack.unpackb(payload), problems


def summary(contract: Contract, name: str | None, value: Any) -> dict:
    """What a reader usually wants from a message: ids, steps, and the reward."""
    if name == "Rollout":
        rewards = [contract.field("RolloutSample", s, "reward") for s in value["samples"]]
        return {"task_id": value["task_id"], "rewards": rewards}
    if name == "Task":
        return {"task_id": value["task_id"], "step": value["step"]}
    if name == "StepMetrics" and "reward/mean" in value["metrics"]:
        return {"step": value["step"], "reward/mean": value["metrics"]["reward/mean"]}
    return {}


def check(
    contract: Contract, storage_dir: Path, transport: str, subject: str, data: bytes, headers: dict
) -> dict:
    """One stored message as a JSON-able record: which message it is and what is wrong."""
    value, problems = decode(contract, storage_dir, data, headers)
    name = contract.message_name(transport, subject, value)
    if name is None:
        problems.append(f"no message of the contract fits {subject}")
    else:
        problems += contract.problems(name, value)
    record = {"transport": transport, "subject": subject, "message": name, "problems": problems}
    return record if problems else record | summary(contract, name, value)


async def direct_get(nc: nats.NATS, stream: str, request: dict, subject: str = "") -> Any:
    """One direct get (`$JS.API.DIRECT.GET.<stream>[.<subject>]`): the reply message, or None
    when the server has none (status 404)."""
    api = f"$JS.API.DIRECT.GET.{stream}" + (f".{subject}" if subject else "")
    reply = await nc.request(api, json.dumps(request).encode() if request else b"", timeout=5)
    if (reply.headers or {}).get("Status") == "404":
        return None
    return reply


async def stream_range(nc: nats.NATS, stream: str, subjects_filter: str = "") -> dict:
    """STREAM.INFO: `state` holds `first_seq`, `last_seq`, `messages` (and `subjects` when filtered)."""
    request = json.dumps({"subjects_filter": subjects_filter}).encode() if subjects_filter else b""
    reply = await nc.request(f"$JS.API.STREAM.INFO.{stream}", request, timeout=5)
    return json.loads(reply.data)["state"]


async def read_stream(nc: nats.NATS, stream: str, first_seq: int, last_seq: int) -> list[Any]:
    """Messages stored with `first_seq <= seq <= last_seq`, without a consumer: each direct get
    returns the next one still stored (a work queue removes acked ones)."""
    found, seq = [], first_seq
    while seq <= last_seq:
        msg = await direct_get(nc, stream, {"seq": seq, "next_by_subj": ">"})
        if msg is None or int(msg.headers["Nats-Sequence"]) > last_seq:
            break
        found.append(msg)
        seq = int(msg.headers["Nats-Sequence"]) + 1
    return found


async def read_streams(nc: nats.NATS, contract: Contract, storage_dir: Path) -> tuple[list, dict]:
    """Every message stored in the run's streams, checked; and each stream's last sequence."""
    records, last = [], {}
    for stream in contract.names("jetstream", "stream"):
        state = await stream_range(nc, stream)
        last[stream] = state["last_seq"]
        for msg in await read_stream(nc, stream, state["first_seq"], state["last_seq"]):
            subject = msg.headers["Nats-Subject"]
            records.append(
                check(contract, storage_dir, "jetstream", subject, msg.data, msg.headers)
            )
    return records, last


async def read_buckets(nc: nats.NATS, contract: Contract, storage_dir: Path) -> list[dict]:
    """The current value of every key of the run's KV buckets, checked (deleted, expired and
    private keys skipped)."""
    records = []
    for bucket in contract.names("kv", "bucket"):
        state = await stream_range(nc, f"KV_{bucket}", f"$KV.{bucket}.>")
        for subject in sorted(state.get("subjects") or {}):
            key = subject.removeprefix(f"$KV.{bucket}.")
            msg = await direct_get(nc, f"KV_{bucket}", {}, subject)
            deleted = msg is None or (msg.headers or {}).get("KV-Operation") in DELETED
            if deleted or not msg.data or key in contract.private_keys(bucket):
                continue
            records.append(check(contract, storage_dir, "kv", subject, msg.data, {}))
    return records


async def follow(nc: nats.NATS, contract: Contract, storage_dir: Path, last: dict, seconds: float):
    """Print messages stored after `last` (stream -> sequence) for `seconds`, polling twice a
    second. A message acked and removed between two polls of a work queue is not seen."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while loop.time() < deadline:
        for stream, seq in last.items():
            state = await stream_range(nc, stream)
            for msg in await read_stream(nc, stream, seq + 1, state["last_seq"]):
                subject = msg.headers["Nats-Subject"]
                print(
                    json.dumps(
                        check(contract, storage_dir, "jetstream", subject, msg.data, msg.headers)
                    )
                )
                last[stream] = int(msg.headers["Nats-Sequence"])
        await asyncio.sleep(0.5)


async def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--schema", type=Path, default=SCHEMA)
    parser.add_argument("--follow", type=float, default=0.0, metavar="SECONDS")
    args = parser.parse_args(argv)
    bus = read_bus_file(args.run_dir)
    contract = Contract(json.loads(args.schema.read_text()), bus["run"])
    storage_dir = Path(bus["storage_dir"])
    nc = await connect(bus)
    try:
        records, last = await read_streams(nc, contract, storage_dir)
        records += await read_buckets(nc, contract, storage_dir)
        for record in records:
            print(json.dumps(record))
        if args.follow:
            await follow(nc, contract, storage_dir, last, args.follow)
    finally:
        await nc.close()
    return 1 if any(record["problems"] for record in records) else 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
