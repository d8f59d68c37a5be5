"""Datasets written into a local Hugging Face cache the way `hf download --repo-type dataset`
leaves them (HF_HOME/hub/datasets--ORG--NAME/snapshots/REV/...), so tests load a dataset by name
with no network."""

import json
import socket
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

REVISION = "0" * 39 + "1"
HF_VARIABLES_UNSET = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "HF_HUB_CACHE", "HF_DATASETS_CACHE")
"""Unset by `unreachable_hub`: loading by name must find out by itself that only the cache is left."""


def unreachable_hub(hf_home: Path) -> dict[str, str]:
    """HF_HOME and an HF_ENDPOINT that refuses connections (a closed local port): the variables
    of a machine whose hub is out of reach and whose HF cache is `hf_home`."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    return {"HF_HOME": str(hf_home), "HF_ENDPOINT": f"http://127.0.0.1:{closed}"}


def cache_dataset(hf_home: Path, name: str, subsets: dict[str, dict[str, list[dict]]]) -> Path:
    """Write dataset `name` (`org/dataset`) into the hub cache under `hf_home`: `subsets` maps
    each subset (configuration) to its splits, each a list of rows. One subset named `default`
    is the dataset's only configuration. Returns the snapshot directory."""
    repo = hf_home / "hub" / f"datasets--{name.replace('/', '--')}"
    snapshot = repo / "snapshots" / REVISION
    configs = []
    for subset, splits in subsets.items():
        files = []
        for split, rows in splits.items():
            path = snapshot / subset / f"{split}-00000-of-00001.parquet"
            path.parent.mkdir(parents=True, exist_ok=True)
            pq.write_table(pa.Table.from_pylist(rows), path)
            files.append({"split": split, "path": f"{subset}/{split}-*.parquet"})
        configs.append({"config_name": subset, "data_files": files})
    # The dataset card's YAML header is where the hub declares a dataset's subsets.
    card = (
        "---\nconfigs:\n"
        + "".join(
            f"- config_name: {c['config_name']}\n  data_files:\n"
            + "".join(
                f"  - split: {f['split']}\n    path: {json.dumps(f['path'])}\n"
                for f in c["data_files"]
            )
            for c in configs
        )
        + "---\n"
    )
    (snapshot / "README.md").write_text(card)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(REVISION)
    return snapshot


def reverse_rows(texts: list[str]) -> list[dict]:
    """Reverse-text rows in prompt/completion format (lists of messages)."""
    return [
        {
            "prompt": [
                {"role": "system", "content": "Reverse the text character by character."},
                {"role": "user", "content": text},
            ],
            "completion": [{"role": "assistant", "content": text[::-1]}],
        }
        for text in texts
    ]
