"""SFT data sources: a Hugging Face dataset by name, a local file, or a saved dataset, read as
conversations (lists of `{role, content, ...}` messages).

A dataset by name (`data.name`, `[[data.sources]] name`) is loaded with `datasets`:
- from the hub when it answers (checked with one short request first, so an unreachable hub costs
  seconds, not the minute of retries `datasets` spends on its own);
- otherwise (or with `HF_HUB_OFFLINE=1`) from the local HF cache: the files `hf download
  --repo-type dataset NAME` put in the hub cache, else the copy `datasets` prepared on an earlier
  online load;
- neither: one error line naming the dataset and how to get it.

A row becomes a conversation through its columns (rlbus.configs.sft.ColumnsConfig): the messages
column when the row has it, else the prompt and completion columns (lists of messages, or strings
taken as the user's turn and the assistant's answer).
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from rlbus.configs.sft import ColumnsConfig, SFTSourceConfig

Conversation = list[dict[str, Any]]

HUB_PROBE_TIMEOUT_S = 5.0
"""How long the hub may take to answer the reachability check before the local cache is used."""


def load_conversations(source: SFTSourceConfig) -> list[Conversation]:
    """Every conversation of `source` (a ValueError with one line when it cannot be read)."""
    rows = _local_rows(source.path) if source.path else hub_rows(source)
    where = f"data source {source.label!r}"
    conversations = [to_conversation(row, source, where) for row in rows]
    if not conversations:
        raise ValueError(f"{where} holds no conversations")
    return conversations


def to_conversation(row: dict[str, Any], columns: ColumnsConfig, where: str) -> Conversation:
    """One row's conversation (see the module docstring)."""
    if row.get(columns.messages_column) is not None:
        return _messages(row[columns.messages_column], "assistant")
    prompt, completion = row.get(columns.prompt_column), row.get(columns.completion_column)
    if prompt is None or completion is None:
        raise ValueError(
            f"{where}: a row has neither a {columns.messages_column!r} column nor both "
            f"{columns.prompt_column!r} and {columns.completion_column!r} (its columns: "
            f"{sorted(row)}); name the dataset's columns with data.messages_column or "
            "data.prompt_column and data.completion_column"
        )
    return _messages(prompt, "user") + _messages(completion, "assistant")


def _messages(value: Any, default_role: str) -> Conversation:
    """A column's value as messages: a string is one message of `default_role`; absent (None)
    fields of a message are dropped, so a tool call's row does not carry `content: None`."""
    if isinstance(value, str):
        return [{"role": default_role, "content": value}]
    messages = []
    for message in value:
        kept = {k: v for k, v in dict(message).items() if v is not None}
        kept.setdefault("content", "")
        messages.append(kept)
    return messages


def _local_rows(path: str) -> Iterable[dict[str, Any]]:
    p = Path(path)
    if not p.exists():
        raise ValueError(
            f"sft data.path {path!r} does not exist: give a JSONL/Parquet file, a saved "
            "`datasets` directory, a Hugging Face dataset as data.name, or the built-in "
            "'reverse-text'"
        )
    if p.is_dir():
        import datasets

        loaded = datasets.load_from_disk(str(p))
        if isinstance(loaded, datasets.DatasetDict):
            loaded = loaded["train"] if "train" in loaded else next(iter(loaded.values()))
        return loaded
    if p.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(p).to_pylist()
    with open(p) as f:
        return [json.loads(line) for line in f if line.strip()]


def hub_rows(source: SFTSourceConfig) -> Iterable[dict[str, Any]]:
    """The rows of `source.name` (its subset and split), from the hub or the local HF cache."""
    import datasets

    assert source.name is not None
    if not _offline() and hub_reachable():
        return _load(source, source.name)
    snapshot = _hub_cache_snapshot(source.name)
    if snapshot is not None:
        return _load(source, snapshot)
    datasets.config.HF_HUB_OFFLINE = True  # this process reads no more data from the hub
    try:
        return _load(source, source.name)
    except (ConnectionError, FileNotFoundError):
        pass
    raise ValueError(
        f"data.name {source.name!r}: the Hugging Face hub is unreachable and the dataset is not "
        f"in the local HF cache ({hf_cache('hub').parent}): download it on a machine with network (`hf download "
        f"--repo-type dataset {source.name}`, into the same HF_HOME), or give a local file as "
        "data.path"
    )


def _load(source: SFTSourceConfig, where: str) -> Iterable[dict[str, Any]]:
    """`datasets.load_dataset` of `where` (a hub id or a local snapshot directory), with a wrong
    subset or split named in one line."""
    import datasets

    try:
        return datasets.load_dataset(
            where, source.subset, split=source.split, cache_dir=str(hf_cache("datasets"))
        )
    except ValueError as error:
        text = str(error)
        value: str | None
        if "split" in text.lower():
            field, value = "data.splits", source.split
        elif "config" in text.lower():
            field, value = "data.subsets", source.subset
        else:
            raise
        first_line = text.strip().splitlines()[0]
        raise ValueError(f"{field}: {value!r} is not in {source.name!r} ({first_line})") from None


def hf_cache(kind: str) -> Path:
    """The HF cache folder `kind` (`hub`, `datasets`) as the environment names it now
    (HF_HUB_CACHE / HF_DATASETS_CACHE, else under HF_HOME, else ~/.cache/huggingface): read at
    each call, not frozen when huggingface_hub is imported."""
    own = os.environ.get("HF_HUB_CACHE" if kind == "hub" else "HF_DATASETS_CACHE")
    if own:
        return Path(own).expanduser()
    home = os.environ.get("HF_HOME") or Path("~/.cache/huggingface")
    return Path(home).expanduser() / kind


def _offline() -> bool:
    return any(
        os.environ.get(var, "").strip().lower() in ("1", "true", "yes", "on")
        for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
    )


def hub_reachable() -> bool:
    """Whether the hub (HF_ENDPOINT) answers an HTTP request within HUB_PROBE_TIMEOUT_S."""
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")
    try:
        urllib.request.urlopen(
            urllib.request.Request(endpoint + "/api/whoami-v2", method="HEAD"),
            timeout=HUB_PROBE_TIMEOUT_S,
        )
    except urllib.error.HTTPError:
        return True  # it answered (401 without a token)
    except OSError:
        return False
    return True


def _hub_cache_snapshot(name: str) -> str | None:
    """The local snapshot directory of dataset `name` in the hub cache, if it was downloaded."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return snapshot_download(
            name, repo_type="dataset", local_files_only=True, cache_dir=hf_cache("hub")
        )
    except LocalEntryNotFoundError:
        return None
