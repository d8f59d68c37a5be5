"""Draw the Grafana dashboard's panels into one PNG, from a Prometheus, without Grafana.

    python deploy/grafana/preview.py --prometheus http://127.0.0.1:9090 --run my-run \\
        --start 1765000000 --end 1765000120 --out dashboard.png

Every panel of `dashboards/rlbus.json` is one chart; every query of the panel is run as written
(`$run` -> the run's name, `$__rate_interval` -> `--rate-interval`) with Prometheus'
`/api/v1/query_range`, one line per series, named by the query's `legendFormat`. It is how the
dashboard screenshot in docs/observability.md was made, and a way to look at a run on a machine
where Grafana cannot be installed.
"""

import argparse
import json
import math
import re
import sys
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

DASHBOARD = Path(__file__).resolve().parent / "dashboards" / "rlbus.json"


def query_range(prometheus: str, expr: str, start: float, end: float, step: float) -> list[dict]:
    params = urllib.parse.urlencode({"query": expr, "start": start, "end": end, "step": step})
    try:
        with urllib.request.urlopen(f"{prometheus}/api/v1/query_range?{params}", timeout=30) as r:
            answer = json.load(r)
    except urllib.error.HTTPError as error:  # Prometheus says why in a JSON body
        answer = json.loads(error.read() or b"{}")
    if answer.get("status") != "success":
        raise RuntimeError(f"{expr}: {answer.get('error', answer)}")
    return answer["data"]["result"]


def legend(template: str | None, labels: dict[str, str], expr: str) -> str:
    if template:
        return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), template)
    shown = {k: v for k, v in labels.items() if k not in ("job", "instance", "run", "__name__")}
    return ", ".join(f"{k}={v}" for k, v in sorted(shown.items())) or expr[:40]


def render(args) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [p for p in json.loads(DASHBOARD.read_text())["panels"] if p.get("targets")]
    columns = 4
    rows = math.ceil(len(panels) / columns)
    fig, axes = plt.subplots(rows, columns, figsize=(5 * columns, 3.2 * rows), squeeze=False)
    empty = []
    for ax, panel in zip(axes.flat, panels, strict=False):
        drawn = 0
        for target in panel["targets"]:
            expr = (
                target["expr"]
                # a regex inside a PromQL string: its backslashes are escaped once more
                .replace("$run", re.escape(args.run).replace("\\", "\\\\"))
                .replace("$__rate_interval", args.rate_interval)
            )
            for series in query_range(args.prometheus, expr, args.start, args.end, args.step):
                times = [float(t) - args.start for t, _ in series["values"]]
                values = [float(v) for _, v in series["values"]]
                name = legend(target.get("legendFormat"), series["metric"], expr)
                ax.plot(times, values, label=name[:38], linewidth=1.2)
                drawn += 1
        if not drawn:
            empty.append(panel["title"])
        ax.set_title(panel["title"], fontsize=10)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=6, loc="best")
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    fig.suptitle(f"rlbus dashboard, run {args.run} (seconds since {args.start:.0f})", fontsize=12)
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=90)
    plt.close(fig)
    print(f"panels without data: {', '.join(empty) or 'none'}")
    return args.out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prometheus", default="http://127.0.0.1:9090")
    parser.add_argument("--run", required=True, help="the run's name (the `run` target label)")
    parser.add_argument("--start", type=float, required=True, help="unix seconds")
    parser.add_argument("--end", type=float, required=True, help="unix seconds")
    parser.add_argument("--step", type=float, default=2.0, help="seconds between points")
    parser.add_argument("--rate-interval", default="15s", help="what $__rate_interval becomes")
    parser.add_argument("--out", type=Path, default=Path("dashboard.png"))
    args = parser.parse_args(argv)
    try:
        print(render(args))
    except (urllib.error.URLError, OSError) as error:
        sys.exit(f"preview: Prometheus at {args.prometheus} did not answer ({error}): --prometheus")
    except RuntimeError as error:
        sys.exit(f"preview: a dashboard query failed: {error}")


if __name__ == "__main__":
    main()
