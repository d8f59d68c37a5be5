"""The generated bus contract (docs/bus-schema.json, docs/bus-messages.md) tells the truth about
the wire structs: it is up to date, covers every message, and lists fields in encoding order."""

import dataclasses
import importlib
import inspect
import json
import pkgutil
from typing import Any

import jsonschema
import msgspec

import rlbus.wire
from rlbus.wire import tasks
from rlbus.wire.base import Message
from rlbus_launch import schema


class Task(tasks.Task, kw_only=True):
    """`tasks.Task` with one more field, as if one were added without regenerating the docs."""

    priority: int = 0


def documented() -> dict[str, Any]:
    return json.loads((schema.DOCS_DIR / schema.JSON_NAME).read_text())


def wire_structs() -> set[type[msgspec.Struct]]:
    """Every struct class defined in a module of `rlbus.wire`."""
    found = set()
    for info in pkgutil.iter_modules(rlbus.wire.__path__):
        module = importlib.import_module(f"rlbus.wire.{info.name}")
        found |= {
            cls
            for _, cls in inspect.getmembers(module, inspect.isclass)
            if issubclass(cls, msgspec.Struct) and cls.__module__ == module.__name__
        }
    return found


def registry_with_grown_task() -> tuple[schema.MessageSpec, ...]:
    def grown(spec: schema.MessageSpec) -> schema.MessageSpec:
        if spec.cls is not tasks.Task:
            return spec
        example = Task(**msgspec.structs.asdict(spec.example))
        return dataclasses.replace(spec, cls=Task, example=example)

    return tuple(map(grown, schema.REGISTRY))


def test_checked_in_bus_docs_match_the_wire_messages():
    stale = schema.stale_files(schema.DOCS_DIR)
    assert stale == [], f"stale: {stale}; run `{schema.REGENERATE}`"


def test_check_names_the_stale_files_when_a_field_was_added_without_regenerating(tmp_path, capsys):
    assert schema.main(["--write", "--docs-dir", str(tmp_path)]) == 0
    assert schema.main(["--check", "--docs-dir", str(tmp_path)]) == 0
    capsys.readouterr()

    grown = registry_with_grown_task()
    assert schema.main(["--check", "--docs-dir", str(tmp_path)], registry=grown) == 1
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1
    assert schema.JSON_NAME in error and schema.MARKDOWN_NAME in error
    assert schema.REGENERATE in error
    assert "`priority`" in schema.generated_files(grown)[schema.MARKDOWN_NAME]


def test_every_wire_message_has_a_registry_entry():
    messages = {cls for cls in wire_structs() if issubclass(cls, Message) and cls is not Message}
    registered = {spec.cls for spec in schema.REGISTRY}
    missing = sorted(cls.__name__ for cls in messages - registered)
    assert missing == [], "add these to rlbus_launch.schema.REGISTRY (route and example)"
    assert len(registered) == len(schema.REGISTRY)


def test_every_wire_struct_is_documented_with_a_json_schema():
    doc = documented()
    names = {cls.__name__ for cls in wire_structs() if cls is not Message}
    assert names == set(doc["messages"]) | set(doc["structs"])
    assert names == set(doc["$defs"])


def test_every_subject_of_the_index_names_documented_messages_and_a_way_to_tell_them_apart():
    doc = documented()
    for entry in doc["subjects"]:
        tags = [doc["messages"][name]["tag"] for name in entry["messages"]]
        if len(tags) > 1:
            assert entry["tag_field"] is not None and len(set(tags)) == len(tags), entry


def assert_encoded_in_documented_order(
    value: Any, encoded: Any, doc: dict[str, Any], seen: set[str]
) -> None:
    """Walk a struct and its generic msgpack decoding side by side: every map's keys (every
    array_like struct's positions) are the documented fields, in the documented order."""
    if isinstance(value, msgspec.Struct):
        name = type(value).__name__
        seen.add(name)
        entry = doc["messages"].get(name) or doc["structs"][name]
        fields = [row["name"] for row in entry["fields"]]
        if entry["encoding"] == "msgpack array (positional)":
            assert isinstance(encoded, list) and len(encoded) == len(fields), name
            pairs = zip(fields, encoded, strict=True)
        else:
            assert list(encoded) == fields, name
            pairs = encoded.items()
        for field, item in pairs:
            if field == entry["tag_field"]:
                assert item == entry["tag"]
            else:
                assert_encoded_in_documented_order(getattr(value, field), item, doc, seen)
    elif isinstance(value, list):
        for item, encoded_item in zip(value, encoded, strict=True):
            assert_encoded_in_documented_order(item, encoded_item, doc, seen)
    elif isinstance(value, dict):
        for key, item in value.items():
            assert_encoded_in_documented_order(item, encoded[key], doc, seen)
    else:
        assert encoded == value


def test_documented_field_order_is_msgspec_encoding_order():
    doc = documented()
    seen: set[str] = set()
    for spec in schema.REGISTRY:
        encoded = msgspec.msgpack.decode(msgspec.msgpack.encode(spec.example))  # no type: generic
        assert_encoded_in_documented_order(spec.example, encoded, doc, seen)
    assert seen == set(doc["messages"]) | set(doc["structs"]), "an example leaves a struct out"


def test_each_example_is_its_message_and_valid_under_its_json_schema():
    doc = documented()
    for spec in schema.REGISTRY:
        assert type(spec.example) is spec.cls
        validator = jsonschema.Draft202012Validator(
            {"$defs": doc["$defs"], "$ref": f"#/$defs/{spec.name}"}
        )
        validator.validate(msgspec.to_builtins(spec.example))
        assert doc["messages"][spec.name]["example"] == msgspec.to_builtins(spec.example)


def test_field_docstrings_are_read_from_the_source():
    rows = {row["name"]: row for row in schema.field_rows(tasks.Task)}
    assert rows["step"]["description"] == "The training step this group is meant for."
    assert "description" not in rows["env_id"]
    assert rows["example_id"]["default"] is None and not rows["example_id"]["required"]
    assert rows["created_at"]["default_factory"].startswith("now(): ")
