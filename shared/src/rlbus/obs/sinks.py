"""Where step rows go: the sinks of a `monitors` config (`rl`'s monitor process, `sft`'s rank 0)."""

import importlib.util
import json
import os
import re
import secrets
from pathlib import Path
from typing import Any, Literal, Protocol

from rlbus.configs.base import exit_with_config_error
from rlbus.configs.common import MonitorsConfig, WandbMonitorConfig
from rlbus.rundirs import EVALS_FILE, rollouts_file
from rlbus.samples import read_records

WANDB_MISSING = (
    "monitors.wandb is enabled but wandb is not installed: install it with "
    "`uv sync --group wandb`, or drop --monitors.wandb"
)
WANDB_NO_LOGIN = (
    "monitors.wandb logs online but wandb has no login here (no WANDB_API_KEY, no netrc entry): "
    "run `wandb login`, set WANDB_API_KEY, or add --monitors.wandb.offline"
)
WANDB_ID_FILE = "wandb/rlbus_run_id"
"""Under the run directory: the id of the run's wandb run, made on first use."""
WANDB_ID_RESERVED = re.compile(r"[:;,#?/'\\\s]+")
"""Characters wandb refuses in a run id."""


class JoinedRow(dict[str, Any]):
    """A step's row as metrics.jsonl holds it (a plain dict to every sink), plus `service_keys`:
    each service metric's key under its service's name (`loss` -> `trainer/loss`), which the
    wandb sink logs it as. The row's own keys cannot say which service sent them: a name two
    services send is prefixed only for the one that reported second."""

    def __init__(self, values: dict[str, Any], service_keys: dict[str, str]) -> None:
        super().__init__(values)
        self.service_keys = service_keys


class RowSink(Protocol):
    """Where step rows go: each row is written to every sink, which is closed at the end."""

    def write(self, row: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class JsonlSink:
    """Appends one JSON object per step to a file, flushed to disk row by row.

    A torn last line (the writer was killed mid-row) is cut off on open, so the next row starts
    on a line of its own; that row's events were not acked, so it is written again whole."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        cut_torn_tail(path)
        self._file = open(path, "a", encoding="utf-8")

    def write(self, row: dict[str, Any]) -> None:
        self._file.write(json.dumps(row, sort_keys=True) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        self._file.close()


def cut_torn_tail(path: Path) -> None:
    """Truncate `path` after its last newline (nothing to do for a missing or clean file)."""
    if not path.exists():
        return
    with open(path, "rb+") as f:
        data = f.read()
        end = data.rfind(b"\n") + 1
        if end < len(data):
            f.truncate(end)


class WandbSink:
    """Logs rows to one wandb run, at `step=row["step"]` so the x axis is the training step.

    Evaluation rows (`write_eval`) are logged against their own axis `eval/step` (an evaluation of
    step N reports after later steps were logged, which wandb's step would drop), and a step whose
    samples the orchestrator kept (`<run_dir>/rollouts/step_<N>.jsonl`) logs them as the table
    `samples` alongside its row.

        A joined row (monitors/join.py) logs each service metric as `<service>/<metric>`
        (`trainer/loss`, `orchestrator/reward/mean`); what the monitor adds (`weights/*`,
        `dead_letters/total`) and the rows of `sft` keep their keys. The run's files, offline or not,
        go under `<run_dir>/wandb`, and a restarted monitor or a resumed run continues the same wandb
        run (`wandb_run_id`)."""

    def __init__(
        self, config: WandbMonitorConfig, run_id: str, run_dir: Path, run_config: dict[str, Any]
    ) -> None:
        try:
            import wandb
        except ImportError as exc:
            raise RuntimeError(WANDB_MISSING) from exc
        self._wandb = wandb
        self._run_dir = run_dir
        self._run = wandb.init(
            project=config.project,
            entity=config.entity,
            name=config.name or run_id,
            group=config.group,
            tags=config.tags,
            id=wandb_run_id(run_dir, run_id),
            resume="allow",
            dir=str(run_dir),
            mode=wandb_mode(config),
            config=run_config,
        )
        self._run.define_metric("eval/*", step_metric="eval/step")

    def write(self, row: dict[str, Any]) -> None:
        names = row.service_keys if isinstance(row, JoinedRow) else {}
        values = {
            names.get(key, key): value
            for key, value in row.items()
            if key not in ("step", "time") and isinstance(value, (int, float))
        }
        table = self.samples_table(int(row["step"]))
        if table is not None:
            values["samples"] = table
        self._run.log(values, step=row["step"])

    def write_eval(self, row: dict[str, Any]) -> None:
        """One evaluation row (`eval/<env>/*`) against the `eval/step` axis."""
        values = {
            k: v for k, v in row.items() if k.startswith("eval/") and isinstance(v, (int, float))
        }
        self._run.log({**values, "eval/step": row["step"]})

    def samples_table(self, step: int) -> Any:
        """The kept samples of `step` as a wandb Table, None when the step kept none."""
        path = rollouts_file(self._run_dir, step)
        if not path.exists():
            return None
        columns: list[str | int] = [
            "env",
            "example_id",
            "sample",
            "prompt",
            "completion",
            "reward",
            "advantage",
        ]
        rows = [
            [
                r.get("env"),
                str(r.get("example_id")),
                r.get("sample"),
                json.dumps(r.get("prompt"), ensure_ascii=False),
                r.get("completion"),
                r.get("reward"),
                r.get("advantage"),
            ]
            for r in read_records(path)
        ]
        return self._wandb.Table(columns=columns, data=rows)

    def close(self) -> None:
        self._run.finish()


def wandb_mode(config: WandbMonitorConfig) -> Literal["offline", "online"] | None:
    """`offline` or `online` per the config; None, so that wandb reads it, when WANDB_MODE is set
    (an explicit `mode=` would override the user's environment)."""
    if os.environ.get("WANDB_MODE"):
        return None
    return "offline" if config.offline else "online"


def wandb_run_id(run_dir: Path, run_id: str) -> str:
    """The wandb run id of `run_dir`: `<run_id>-<6 hex>`, made once and kept in WANDB_ID_FILE,
    so that restarts and `--resume` log into the same wandb run, and a `--clean` rerun under the
    same name (a new run directory) gets a new one instead of appending to the old."""
    path = run_dir / WANDB_ID_FILE
    if path.exists():
        return path.read_text(encoding="utf-8").strip()
    wandb_id = f"{WANDB_ID_RESERVED.sub('-', run_id)}-{secrets.token_hex(3)}"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(wandb_id + "\n", encoding="utf-8")
    return wandb_id


def check_sinks_installed(monitors: MonitorsConfig) -> None:
    """Called by the launchers before anything starts: an enabled sink whose package is missing,
    or an online wandb without a login, is a config error naming the flag, not a traceback in
    the monitor's log after the run started."""
    if monitors.wandb is None:
        return
    if importlib.util.find_spec("wandb") is None:
        exit_with_config_error(WANDB_MISSING)
    if wandb_online(monitors.wandb) and not wandb_logged_in():
        exit_with_config_error(WANDB_NO_LOGIN)


def wandb_online(config: WandbMonitorConfig) -> bool:
    """Whether the wandb run will talk to a server (WANDB_MODE, when set, wins over the config)."""
    mode = os.environ.get("WANDB_MODE")
    if mode:
        return mode not in ("offline", "disabled", "dryrun")
    return not config.offline


def wandb_logged_in() -> bool:
    """An API key in the environment, or a netrc entry for the wandb host (what `wandb login`
    writes); checked without importing wandb."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    import netrc
    from urllib.parse import urlsplit

    host = urlsplit(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname or ""
    path = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    try:
        return netrc.netrc(path).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def build_sinks(
    monitors: MonitorsConfig, run_id: str, run_dir: Path, run_config: dict[str, Any]
) -> list[JsonlSink | WandbSink]:
    """The sinks `monitors` enables; `run_id` names the wandb run (unless `monitors.wandb.name`
    does), `run_config` is what wandb records as the run's config."""
    sinks: list[JsonlSink | WandbSink] = []
    if monitors.file is not None:
        sinks.append(JsonlSink(run_dir / monitors.file.path))
    if monitors.wandb is not None:
        sinks.append(WandbSink(monitors.wandb, run_id, run_dir, run_config))
    return sinks


class EvalRowSink(Protocol):
    def write_eval(self, row: dict[str, Any]) -> None: ...


class JsonlEvalSink:
    """`<run_dir>/evals.jsonl`: one row per evaluation of one environment (the step rows' file
    holds one row per step, in step order; evaluations report later, so they have their own)."""

    def __init__(self, run_dir: Path) -> None:
        self.jsonl = JsonlSink(run_dir / EVALS_FILE)

    def write_eval(self, row: dict[str, Any]) -> None:
        self.jsonl.write(row)

    def close(self) -> None:
        self.jsonl.close()


def eval_sinks(run_dir: Path, sinks: list[JsonlSink | WandbSink]) -> list[EvalRowSink]:
    """Where evaluation rows go: evals.jsonl, and the wandb run of `sinks` when there is one."""
    return [JsonlEvalSink(run_dir), *(s for s in sinks if isinstance(s, WandbSink))]
