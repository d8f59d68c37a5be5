"""`rl-trace RUN_DIR|FILE... [--step N] [--png OUT]`: one step's trace, without a trace backend.

Reads OTLP-JSON lines: a run's `traces/*.jsonl` (written when no collector is configured) or a
collector's file exporter output. Prints the step's span tree, spans of the same name under the
same parent folded into one line (`orchestrator.rollout x16`, with the min / median / max
duration), and with `--png` draws it as a waterfall: one row per line of the tree, one bar per
span, coloured by service. Jaeger or Tempo show the same trace when a collector is configured
(docs/observability.md).
"""

import argparse
import statistics
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from rlbus.obs import tracing

PALETTE = ("#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3")


@dataclass
class Row:
    """Spans with one name under one row of the tree (one line, one lane of the waterfall)."""

    name: str
    service: str
    depth: int
    spans: list[dict] = field(default_factory=list)
    children: list["Row"] = field(default_factory=list)


def start_ns(span: dict) -> int:
    return int(span["startTimeUnixNano"])


def duration_s(span: dict) -> float:
    return (int(span["endTimeUnixNano"]) - start_ns(span)) / 1e9


def load(paths: list[Path]) -> list[dict]:
    """Spans of every OTLP-JSON file in `paths` (a directory: its `traces/*.jsonl`)."""
    files: list[Path] = []
    for path in paths:
        if not path.exists():
            raise FileNotFoundError(f"{path} does not exist")
        if path.is_dir():
            files.extend(sorted((path / "traces").glob("*.jsonl")) or sorted(path.glob("*.jsonl")))
        else:
            files.append(path)
    if not files:
        raise FileNotFoundError(f"no OTLP-JSON trace files in {', '.join(map(str, paths))}")
    return [span for f in files for span in tracing.read_otlp_json(f)]


def step_of(span: dict) -> int | None:
    value = tracing.attribute_map(span.get("attributes", [])).get(tracing.STEP_ATTR)
    return int(value) if value is not None else None


def steps(spans: list[dict]) -> list[int]:
    """Steps that have a root span, in order."""
    return sorted({s for s in map(step_of, spans_named(spans, tracing.STEP)) if s is not None})


def spans_named(spans: list[dict], name: str) -> list[dict]:
    return [s for s in spans if s["name"] == name]


def step_spans(spans: list[dict], step: int) -> list[dict]:
    """The spans of step `step`'s trace (empty when it has none)."""
    roots = [s for s in spans_named(spans, tracing.STEP) if step_of(s) == step]
    if not roots:
        return []
    trace_id = roots[0]["traceId"]
    return [s for s in spans if s["traceId"] == trace_id]


def tree(trace: list[dict]) -> list[Row]:
    """The trace folded into rows: children of every span in a row, grouped by (service, name)."""
    children = defaultdict(list)
    ids = {s["spanId"] for s in trace}
    for span in trace:
        parent = span.get("parentSpanId")
        children[parent if parent in ids else None].append(span)

    def rows(parents: list[dict], depth: int) -> list[Row]:
        grouped: dict[tuple[str, str], Row] = {}
        for parent_id in [None] if depth == 0 else [p["spanId"] for p in parents]:
            for span in children.get(parent_id, []):
                key = (span["service"], span["name"])
                grouped.setdefault(key, Row(span["name"], span["service"], depth)).spans.append(
                    span
                )
        ordered = sorted(grouped.values(), key=lambda r: min(map(start_ns, r.spans)))
        for row in ordered:
            row.children = rows(row.spans, depth + 1)
        return ordered

    return rows([], 0)


def flatten(rows: list[Row]) -> list[Row]:
    return [r for row in rows for r in [row, *flatten(row.children)]]


def describe(row: Row, origin_ns: int) -> str:
    durations = sorted(map(duration_s, row.spans))
    offset = (min(map(start_ns, row.spans)) - origin_ns) / 1e6
    if len(durations) == 1:
        timing = f"{durations[0] * 1e3:9.1f} ms"
    else:
        timing = (
            f"{statistics.median(durations) * 1e3:9.1f} ms median "
            f"({durations[0] * 1e3:.1f}-{durations[-1] * 1e3:.1f})"
        )
    count = f" x{len(row.spans)}" if len(row.spans) > 1 else ""
    label = "  " * row.depth + row.name + count
    return f"{offset:9.1f} ms  {row.service:<12} {label:<44} {timing}"


def render_text(trace: list[dict], step: int) -> str:
    rows = flatten(tree(trace))
    origin = min(map(start_ns, trace))
    services = sorted({s["service"] for s in trace})
    head = (
        f"step {step}: trace {trace[0]['traceId']}, {len(trace)} spans from "
        f"{', '.join(services)}\n{'start':>12}  {'service':<12} {'span':<44} duration"
    )
    return "\n".join([head, *(describe(row, origin) for row in rows)])


def render_png(trace: list[dict], step: int, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = flatten(tree(trace))
    origin = min(map(start_ns, trace))
    services = sorted({s["service"] for s in trace})
    colours = {s: PALETTE[i % len(PALETTE)] for i, s in enumerate(services)}
    fig, ax = plt.subplots(figsize=(12, 0.32 * len(rows) + 1.2))
    for index, row in enumerate(rows):
        for span in row.spans:
            left = (start_ns(span) - origin) / 1e6
            ax.barh(index, max(duration_s(span) * 1e3, 0.5), left=left, height=0.6,
                    color=colours[row.service], alpha=0.75 if len(row.spans) > 1 else 1.0)  # fmt: skip
    labels = [
        "· " * r.depth + r.name + (f" x{len(r.spans)}" if len(r.spans) > 1 else "") for r in rows
    ]
    ax.set_yticks(range(len(rows)), labels, fontsize=8, fontfamily="monospace", ha="left")
    ax.tick_params(axis="y", pad=max(map(len, labels)) * 5.2)
    ax.invert_yaxis()
    ax.set_xlabel("ms since the step's first span")
    ax.set_title(
        f"rlbus step {step}: {len(trace)} spans, one trace ({trace[0]['traceId'][:16]}...)"
    )
    handles = [plt.Rectangle((0, 0), 1, 1, color=colours[s]) for s in services]
    ax.legend(handles, services, loc="lower right", fontsize=8)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="rl-trace", description=__doc__.splitlines()[0])
    parser.add_argument(
        "paths", nargs="+", type=Path, help="run directory (its traces/) or OTLP-JSON files"
    )
    parser.add_argument("--step", type=int, default=None, help="step to show (default: the last)")
    parser.add_argument("--png", type=Path, default=None, help="also draw it into this PNG file")
    args = parser.parse_args(argv)
    try:
        spans = load(args.paths)
    except (FileNotFoundError, ValueError, KeyError) as error:
        sys.exit(f"rl-trace: {error}")
    known = steps(spans)
    if not known:
        sys.exit("rl-trace: no step traces (orchestrator.step spans) in these files")
    step = known[-1] if args.step is None else args.step
    trace = step_spans(spans, step)
    if not trace:
        sys.exit(f"rl-trace: --step {step} has no trace; steps with one: {known[0]}-{known[-1]}")
    print(render_text(trace, step))
    if args.png is not None:
        print(render_png(trace, step, args.png))


if __name__ == "__main__":
    main()
