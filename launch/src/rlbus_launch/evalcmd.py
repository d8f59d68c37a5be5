"""`rl eval`: evaluate a run's weights, a model directory or a running server, outside a run.

    rl eval RUN_DIR [--step N] [--checkpoint]  the weights of step N of a run (default: its newest;
                                               0: the model it started from): broadcasts/step_N,
                                               else (or with --checkpoint) its trainer checkpoint
                                               exported; on the run's own eval config
    rl eval --model DIR [--config rl.toml]     a model directory (or hub id) on the eval config of
                                               an `rl` config file (default: rl's defaults)
    ... [--inference-url URL]                  an OpenAI API root of a running server instead of
                                               starting one (its model: --model, else what it serves)
    ... [--out DIR]                            where the results go (default: RUN_DIR/evals/command/
                                               step_<N>, or outputs/eval--<model>--<id>)

Unless attached, it starts an inference server on free ports with the run's (or the config's)
inference settings and the model swapped in (`python -m rlbus_inference.entrypoint`, no bus),
waits until it answers, runs `python -m rlbus_orchestrator.evaluate` (the in-run evaluation's
code, rlbus_orchestrator.evaluation), prints a table of the results and stops the server by its
pid. DIR then holds `results.json`, `samples.jsonl`, `configs/` and `logs/`.
"""

import argparse
import json
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import structlog
from rich.console import Console
from rich.table import Table

from rlbus.configs import RLConfig
from rlbus.configs.base import config_to_toml, parse_cli
from rlbus.configs.bus import BusConfig
from rlbus.configs.inference import InferenceConfig
from rlbus.configs.orchestrator import EvalConfig, OrchestratorConfig
from rlbus.netutil import free_ports
from rlbus.rundirs import (
    BROADCASTS_DIR,
    EVAL_RESULTS_FILE,
    EVAL_SAMPLES_FILE,
    EVALS_DIR,
    complete_steps,
    numbered_steps,
    short_id,
    slug,
)
from rlbus_launch.plan import python_module_argv
from rlbus_launch.supervisor import ServiceProcess

log = structlog.get_logger()

SERVER_START_TIMEOUT_S = 900.0
"""How long vLLM may take to answer (a cold start on CPU takes a minute or two)."""
EXPORTED_MODEL = "model"
"""`<out>/model/`: a checkpoint exported for serving (rlbus_trainer.export_checkpoint)."""
COMMAND_EVALS = "command"
"""`RUN_DIR/evals/command/step_<N>/`: the command's evaluations of a run, beside the in-run ones."""


class EvalCommandError(Exception):
    """Bad input: one line for the user, exit 2."""


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="rl eval", description=__doc__.split("\n")[0])
    parser.add_argument("run_dir", nargs="?", type=Path, help="a run directory")
    parser.add_argument("--step", type=int, help="the step whose weights to evaluate (RUN_DIR)")
    parser.add_argument(
        "--checkpoint",
        action="store_true",
        help="serve the step's trainer checkpoint even when broadcasts/ has its weights",
    )
    parser.add_argument("--model", help="a model directory or id (instead of RUN_DIR)")
    parser.add_argument("--config", type=Path, help="an rl config file with [orchestrator.eval]")
    parser.add_argument("--inference-url", help="an OpenAI API root of a running server")
    parser.add_argument("--out", type=Path, help="where the results go")
    args = parser.parse_args(argv)
    if (args.run_dir is None) == (args.model is None and args.inference_url is None):
        parser.error("give a RUN_DIR, or --model / --inference-url (not both)")
    if args.run_dir is None and (args.step is not None or args.checkpoint):
        parser.error("--step and --checkpoint go with RUN_DIR")
    return args


def run_configs(run_dir: Path) -> tuple[OrchestratorConfig, InferenceConfig]:
    """The resolved orchestrator and inference configs a run's launcher wrote."""
    configs = run_dir / "configs"
    orchestrator = configs / "orchestrator.toml"
    inference = next(
        (p for p in (configs / "inference.toml", configs / "inference-0.toml") if p.exists()), None
    )
    if not orchestrator.exists() or inference is None:
        raise EvalCommandError(
            f"{run_dir} is no run directory of `rl` (no configs/orchestrator.toml and "
            "configs/inference.toml): pass the directory a run wrote, e.g. outputs/<run name>"
        )
    return (
        parse_cli(OrchestratorConfig, ["@", str(orchestrator)], prog="rl eval"),
        parse_cli(InferenceConfig, ["@", str(inference)], prog="rl eval"),
    )


def step_weights(
    run_dir: Path, step: int | None, base_model: str, *, from_checkpoint: bool = False
) -> tuple[int, str | None]:
    """(step, model to serve; None: export the step's checkpoint first). Step 0 is the model the
    run started from, step N the weights the trainer wrote for inference (`broadcasts/step_N`, a
    Hugging Face directory), else its complete checkpoint `checkpoints/step_N`; the default step
    is the newest of either."""
    root = run_dir / BROADCASTS_DIR
    kept = [s for s in numbered_steps(root) if (root / f"step_{s}" / "config.json").exists()]
    checkpoints = complete_steps(run_dir)
    if step is None:
        step = max([*kept, *checkpoints], default=0)
    if step == 0:
        return 0, base_model
    if step in kept and not from_checkpoint:
        return step, str((root / f"step_{step}").resolve())
    if step in checkpoints:
        return step, None
    raise EvalCommandError(
        f"--step {step}: {run_dir} holds neither weights (broadcasts/: steps "
        f"{', '.join(map(str, [0, *kept]))}) nor a complete checkpoint (checkpoints/: "
        f"{', '.join(map(str, checkpoints)) or 'none'}) of that step"
    )


def served_model(url: str) -> str:
    """The first model an OpenAI server lists."""
    try:
        data = httpx.get(url.rstrip("/") + "/models", timeout=10).json()
        return str(data["data"][0]["id"])
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as error:
        raise EvalCommandError(f"--inference-url {url}: cannot list its models ({error})") from None


@dataclass
class EvalPlan:
    orchestrator: OrchestratorConfig
    inference: InferenceConfig | None
    """The server to start (None: attached to `--inference-url`)."""
    step: int
    out: Path
    export: bool = False
    """Serve step `step`'s trainer checkpoint, exported to `<out>/model` first."""


def plan(args: argparse.Namespace) -> EvalPlan:
    """What to serve, with which configs, and where the results go (module docstring)."""
    if args.run_dir is not None:
        orchestrator, inference = run_configs(args.run_dir)
        step, served = step_weights(
            args.run_dir, args.step, orchestrator.model.name, from_checkpoint=args.checkpoint
        )
        out = args.out or args.run_dir / EVALS_DIR / COMMAND_EVALS / f"step_{step}"
        model = served or str((out / EXPORTED_MODEL).resolve())
        export = served is None
    else:
        rl = parse_cli(RLConfig, ["@", str(args.config)] if args.config else [], prog="rl eval")
        orchestrator, inference = (
            rl.orchestrator.model_copy(deep=True),
            rl.inference.model_copy(deep=True),
        )
        model = args.model or served_model(args.inference_url)
        step = 0
        out = args.out or Path(rl.output_dir) / f"eval--{slug(Path(model).name)}--{short_id()}"
        export = False
    orchestrator.eval = orchestrator.eval or EvalConfig()
    orchestrator.model.name = model
    orchestrator.bus = BusConfig()
    if args.inference_url:
        orchestrator.inference_urls = [args.inference_url]
        return EvalPlan(orchestrator, None, step, out, export)
    inference = local_server(inference, model)
    orchestrator.inference_urls = [f"http://127.0.0.1:{inference.server.port}/v1"]
    return EvalPlan(orchestrator, inference, step, out, export)


def local_server(base: InferenceConfig, model: str) -> InferenceConfig:
    """An inference server for evaluations (`rl eval`, `sft`): `base`'s settings serving `model`
    on free loopback ports, without a bus, an attach or a metrics port."""
    server = base.model_copy(deep=True)
    server.vllm.model = model
    server.bus = BusConfig()
    server.attach = None
    server.metrics = None
    server.server.host = "127.0.0.1"
    server.server.port, server.backend_port = free_ports(2)
    return server


def wait_until_serving(server: ServiceProcess, url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise EvalCommandError(
                f"the inference server exited ({server.poll()}); see {server.log_path}:\n{server.tail(20)}"
            )
        try:
            if httpx.get(url.rstrip("/") + "/models", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise EvalCommandError(
        f"the inference server did not answer within {timeout_s:.0f} s; see {server.log_path}"
    )


def results_table(results: dict[str, Any]) -> Table:
    """One row per environment: examples, failed, mean reward and each pass@k / mean@k."""
    table = Table(title=f"eval of step {results['step']} ({results.get('model', '')})")
    metric_names = sorted(
        {k.split("/", 2)[2] for m in results["envs"].values() for k in m if "@" in k},
        key=lambda name: (name.split("@")[0], int(name.split("@")[1])),
    )
    for column in ["env", "examples", "failed", "reward", *metric_names]:
        if column == "env":
            table.add_column(column, no_wrap=True)
        else:
            table.add_column(column, justify="right")
    for env, m in results["envs"].items():
        prefix = f"eval/{env}/"
        cells = [
            env,
            f"{m.get(prefix + 'num_examples', 0):.0f}",
            f"{m.get(prefix + 'failed', 0):.0f}",
            *(
                f"{m[prefix + k]:.4f}" if prefix + k in m else "-"
                for k in ["reward/mean", *metric_names]
            ),
        ]
        table.add_row(*cells)
    return table


def export_checkpoint(run_dir: Path, step: int, out: Path, launch_id: str) -> None:
    """Write step `step`'s trainer checkpoint as `<out>/model` (rlbus_trainer.export_checkpoint)."""
    print(
        f"rl eval: exporting {run_dir}/checkpoints/step_{step} to {out / EXPORTED_MODEL}",
        flush=True,
    )
    exporter = ServiceProcess(
        name="export",
        argv=[
            sys.executable,
            "-m",
            "rlbus_trainer.export_checkpoint",
            *(str(run_dir.absolute()), str(step), str((out / EXPORTED_MODEL).absolute())),
            "--merged",  # a LoRA run's adapter folded in: the server loads a whole model
        ],
        log_path=out / "logs" / "export.log",
        launch_id=launch_id,
    )
    exporter.start()
    while (code := exporter.poll()) is None:
        time.sleep(0.5)
    if code != 0:
        raise EvalCommandError(
            f"exporting the checkpoint failed (exit {code}); see {exporter.log_path}:\n{exporter.tail(20)}"
        )


def run(args: argparse.Namespace) -> int:
    todo = plan(args)
    orchestrator, inference, step, out = todo.orchestrator, todo.inference, todo.step, todo.out
    configs = out / "configs"
    configs.mkdir(parents=True, exist_ok=True)
    orchestrator_file = configs / "orchestrator.toml"
    orchestrator_file.write_text(config_to_toml(orchestrator), encoding="utf-8")
    launch_id = uuid.uuid4().hex  # marked children die with this process (process_marks)
    server = None
    if args.run_dir is not None and orchestrator.model.name == str(
        (out / EXPORTED_MODEL).resolve()
    ):
        export_checkpoint(args.run_dir, step, out, launch_id)
    if inference is not None:
        inference_file = configs / "inference.toml"
        inference_file.write_text(config_to_toml(inference), encoding="utf-8")
        server = ServiceProcess(
            name="inference",
            argv=python_module_argv("rlbus_inference.entrypoint", inference_file.absolute()),
            log_path=out / "logs" / "inference.log",
            launch_id=launch_id,
        )
        server.start()
    try:
        if server is not None:
            print(
                f"rl eval: starting {orchestrator.model.name} (log: {server.log_path})", flush=True
            )
            wait_until_serving(server, orchestrator.inference_urls[0], SERVER_START_TIMEOUT_S)
        evaluator = ServiceProcess(
            name="evaluate",
            argv=[
                sys.executable,
                "-m",
                "rlbus_orchestrator.evaluate",
                str(orchestrator_file.absolute()),
                *("--step", str(step), "--out", str(out.absolute())),
            ],
            log_path=out / "logs" / "evaluate.log",
            launch_id=launch_id,
        )
        evaluator.start()
        while (code := evaluator.poll()) is None:
            time.sleep(0.5)
        if server is not None and server.poll() is not None:
            print(
                f"rl eval: the inference server died during the evaluation (exit "
                f"{server.poll()}); its problems count as failed; see {server.log_path}",
                file=sys.stderr,
            )
        if code != 0:
            print(
                f"rl eval: the evaluation failed (exit {code}); see {evaluator.log_path}:\n{evaluator.tail(20)}",
                file=sys.stderr,
            )
            return 1
    finally:
        if server is not None:
            server.stop()
    results = json.loads((out / EVAL_RESULTS_FILE).read_text(encoding="utf-8"))
    Console().print(results_table(results))
    print(f"rl eval: results in {out / EVAL_RESULTS_FILE}, samples in {out / EVAL_SAMPLES_FILE}")
    return 0


def script_main() -> None:
    """The `eval` script (prime-rl's name for it): `rl eval`."""
    sys.exit(main(sys.argv[1:]))


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    try:
        return run(args)
    except EvalCommandError as error:
        print(f"rl eval: {error}", file=sys.stderr)
        return 2
