"""A bus client written from docs/bus-schema.json alone, as a client in another language would be.

It knows no rlbus type. Given a nats-py connection, it reads messages with the raw JetStream, KV
and core NATS API, decodes msgpack without a type (maps become dicts in the order they were
written), finds each message's schema from its subject (and tag) in the JSON file, validates it
with `jsonschema` and checks that every map's keys come in the documented field order. It also
writes control messages from the documented fields. test_schema_client.py checks that this
module imports nothing from rlbus (nor nats: the bus's layer rule keeps nats-py imports inside
rlbus.bus, so the connection is handed in).
"""

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
from jsonschema import Draft202012Validator

SCHEMA_PATH = Path(__file__).resolve().parents[3] / "docs" / "bus-schema.json"
PLACEHOLDER = re.compile(r"(<[a-z_]+>)")


@dataclass
class Checked:
    """One message read off the bus: which message of the contract it is, and what is wrong."""

    transport: str
    subject: str
    name: str | None
    value: Any
    problems: list[str] = field(default_factory=list)
    claim: dict | None = None
    """The claim check it arrived as, when it did."""


class SchemaClient:
    def __init__(self, nc, run_id: str, storage_dir: Path, doc: dict | None = None):
        self.nc = nc
        self.js = nc.jetstream()
        self.doc = doc or json.loads(SCHEMA_PATH.read_text())
        self.run_id = run_id
        self.storage_dir = storage_dir
        self.structs = self.doc["messages"] | self.doc["structs"]
        self._validators: dict[str, Draft202012Validator] = {}

    # ---- names ------------------------------------------------------------------------------

    def fill(self, pattern: str, **values: str) -> str:
        """`pattern` with `<prefix>`, `<run>` and the given placeholders filled in."""
        text = pattern.replace("<prefix>", self.doc["placeholders"]["<prefix>"]["value"])
        text = text.replace("<run>", self.run_id)
        for name, value in values.items():
            text = text.replace(f"<{name}>", value)
        return text

    def subject_regex(self, pattern: str) -> re.Pattern:
        placeholders = self.doc["placeholders"]
        parts = PLACEHOLDER.split(self.fill(pattern))
        return re.compile(
            "".join(
                f"(?:{placeholders[part]['pattern']})" if part in placeholders else re.escape(part)
                for part in parts
            )
        )

    def subject_entry(self, transport: str, subject: str) -> dict | None:
        matches = [
            entry
            for entry in self.doc["subjects"]
            if entry["transport"] == transport
            and self.subject_regex(entry["subject"]).fullmatch(subject)
        ]
        assert len(matches) <= 1, f"{subject} matches several subject patterns: {matches}"
        return matches[0] if matches else None

    def message_name(self, transport: str, subject: str, value: Any) -> str | None:
        """The message of the contract that `value`, read on `subject`, is (None: none is)."""
        entry = self.subject_entry(transport, subject)
        if entry is None:
            return None
        if entry["tag_field"] is None:
            (name,) = entry["messages"]
            return name
        tag = value.get(entry["tag_field"]) if isinstance(value, dict) else None
        named = [name for name in entry["messages"] if self.doc["messages"][name]["tag"] == tag]
        return named[0] if named else None

    # ---- checking -----------------------------------------------------------------------------

    def validator(self, node: dict) -> Draft202012Validator:
        key = json.dumps(node, sort_keys=True)
        if key not in self._validators:
            self._validators[key] = Draft202012Validator({"$defs": self.doc["$defs"], **node})
        return self._validators[key]

    def problems(self, name: str, value: Any) -> list[str]:
        node = {"$ref": f"#/$defs/{name}"}
        errors = [
            f"{name}{''.join(f'[{p!r}]' for p in error.absolute_path)}: {error.message}"
            for error in self.validator(node).iter_errors(value)
        ]
        return errors + self.order_problems(node, value, name)

    def order_problems(self, node: dict, value: Any, where: str) -> list[str]:
        """Maps of structs whose keys are not in the documented field order, anywhere in `value`."""
        if "$ref" in node:
            return self.struct_order_problems(node["$ref"].rsplit("/", 1)[1], value, where)
        if "anyOf" in node:
            fitting = [b for b in node["anyOf"] if self.validator(b).is_valid(value)]
            return self.order_problems(fitting[0], value, where) if fitting else []
        if isinstance(value, list) and isinstance(node.get("items"), dict):
            return [
                problem
                for index, item in enumerate(value)
                for problem in self.order_problems(node["items"], item, f"{where}[{index}]")
            ]
        if isinstance(value, dict) and isinstance(node.get("additionalProperties"), dict):
            return [
                problem
                for key, item in value.items()
                for problem in self.order_problems(
                    node["additionalProperties"], item, f"{where}.{key}"
                )
            ]
        return []

    def struct_order_problems(self, name: str, value: Any, where: str) -> list[str]:
        definition = self.doc["$defs"][name]
        fields = [row["name"] for row in self.structs[name]["fields"]]
        problems = []
        if isinstance(value, dict):
            if list(value) != fields:
                problems.append(f"{where}: keys {list(value)} are not in the order {fields}")
            children = [
                (definition["properties"].get(key), item, f"{where}.{key}")
                for key, item in value.items()
            ]
        elif isinstance(value, list):  # array_like: positions are the fields in order
            children = [
                (node, item, f"{where}[{index}]")
                for index, (node, item) in enumerate(
                    zip(definition["prefixItems"], value, strict=False)
                )
            ]
        else:
            return []  # a wrong type: the schema validation reports it
        for node, item, at in children:
            if node is not None:
                problems += self.order_problems(node, item, at)
        return problems

    def load_claim(self, claim: dict) -> tuple[bytes, list[str]]:
        path = Path(claim["path"])
        if path.is_absolute() or ".." in path.parts:
            return b"", [f"claim check path {claim['path']!r} is not under the storage dir"]
        data = (self.storage_dir / path).read_bytes()
        problems = []
        if len(data) != claim["size"] or hashlib.sha256(data).hexdigest() != claim["sha256"]:
            problems.append(f"claim check file {claim['path']} has the wrong size or sha256")
        return data, problems

    def check(
        self, transport: str, subject: str, data: bytes, headers: dict[str, str] | None
    ) -> Checked:
        """Decode one message read off the bus and check it against the contract."""
        claim_check = self.doc["claim_check"]
        claim, problems = None, []
        if (headers or {}).get(claim_check["header"]) == claim_check["value"]:
            claim = msgspec.msgpack.decode(data)
            problems += self.problems(claim_check["message"], claim)
            data, file_problems = self.load_claim(claim)
            problems += file_problems
        value = msgspec.msgpack.decode(data)
        name = self.message_name(transport, subject, value)
        if name is None:
            problems.append(f"{transport} {subject}: no message of the contract fits {value!r:.80}")
        else:
            problems += self.problems(name, value)
        return Checked(transport, subject, name, value, problems, claim)

    # ---- reading and writing ----------------------------------------------------------------

    def patterns(self, transport: str, key: str) -> list[str]:
        return sorted({e[key] for e in self.doc["subjects"] if e["transport"] == transport})

    async def read_streams(self) -> list[Checked]:
        """Every message stored in the run's streams, oldest first, each checked."""
        checked = []
        for stream in map(self.fill, self.patterns("jetstream", "stream")):
            state = (await self.js.stream_info(stream)).state
            seq = state.first_seq
            while state.messages and seq <= state.last_seq:
                msg = await self.js.get_msg(stream, seq, next=True)
                checked.append(self.check("jetstream", msg.subject, msg.data, msg.headers))
                seq = msg.seq + 1
        return checked

    async def read_kv(self) -> list[Checked]:
        """The current entry of every key of the run's KV buckets, each checked."""
        checked = []
        for bucket in map(self.fill, self.patterns("kv", "bucket")):
            kv = await self.js.key_value(bucket)
            for key in await kv.keys():
                entry = await kv.get(key)
                checked.append(self.check("kv", f"$KV.{bucket}.{key}", entry.value, None))
        return checked

    def encode(self, name: str, values: dict[str, Any]) -> bytes:
        """A message written from its documented fields: the tag, then each field in order
        (`values`, else its documented default)."""
        entry = self.structs[name]
        message = {}
        for row in entry["fields"]:
            if row["name"] == entry["tag_field"]:
                message[row["name"]] = entry["tag"]
            elif row["name"] in values:
                message[row["name"]] = values[row["name"]]
            else:
                message[row["name"]] = row["default"]  # a KeyError: the caller must give it
        return msgspec.msgpack.encode(message)

    def route_subject(self, transport: str, name: str, **values: str) -> str:
        (entry,) = [
            e for e in self.doc["subjects"] if e["transport"] == transport and name in e["messages"]
        ]
        return self.fill(entry["subject"], **values)

    async def request(self, name: str, values: dict[str, Any], **placeholders: str) -> Checked:
        """Send request `name` on its documented subject; the reply, checked."""
        subject = self.route_subject("request", name, **placeholders)
        reply = await self.nc.request(subject, self.encode(name, values), timeout=5)
        return self.check("reply", subject, reply.data, reply.headers)

    async def serve(self, reply_name: str, values: dict[str, Any], **placeholders: str):
        """Answer every request on `reply_name`'s subject with that reply; returns the list the
        checked requests are appended to."""
        subject = self.route_subject("reply", reply_name, **placeholders)
        served: list[Checked] = []

        async def on_request(msg) -> None:
            served.append(self.check("request", msg.subject, msg.data, msg.headers))
            await msg.respond(self.encode(reply_name, values))

        await self.nc.subscribe(subject, cb=on_request)
        await self.nc.flush()
        return served
