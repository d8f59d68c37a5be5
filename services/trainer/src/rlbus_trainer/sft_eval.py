"""Evaluation on environments during SFT (`[eval]`, docs/evaluating.md "During SFT").

At step 0 (with `eval_base_model`), every `eval.interval` steps and at the last step, rank 0:

1. writes the weights as a Hugging Face directory `<run_dir>/broadcasts/step_<N>/` (step 0: the
   server already serves the starting model) and loads them into the evaluation's inference
   server (`POST /update_weights` on its admin port, with their sha256), keeping only that one;
2. runs `python -m rlbus_orchestrator.evaluate` (the in-run evaluations' code, by module name:
   the trainer never imports the orchestrator) with the config of `SFTEvalConfig.orchestrator`,
   which writes `<run_dir>/evals/step_<N>/results.json` and `samples.jsonl`;
3. returns `eval/<env>/*` for the step's row (beside `val_loss`) and appends the rows of
   `evals.jsonl`.

The server is the one `sft` started (`eval.inference_url` and `eval.admin_url`, set by the
launcher) or one the user runs. Training waits for the evaluation (the other ranks at a
barrier). A failed evaluation is a warning and a row without eval keys, never the end of the
run.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import structlog
import torch.distributed as dist

from rlbus.checksums import weight_files
from rlbus.configs.base import config_to_toml
from rlbus.configs.sft import SFTConfig, SFTEvalConfig
from rlbus.obs.sinks import JsonlEvalSink
from rlbus.rundirs import EVAL_RESULTS_FILE, broadcasts_dir, eval_dir, numbered_steps
from rlbus_trainer.engine import Engine, World
from rlbus_trainer.export import write_model

log = structlog.get_logger()

SERVER_WAIT_S = 900.0
"""How long the first evaluation waits for the server to answer (vLLM starts beside the ranks)."""
EVAL_CONFIG_FILE = "eval-orchestrator.toml"
"""`<run_dir>/configs/`: the config `rlbus_orchestrator.evaluate` runs with."""


class SFTEvaluator:
    """The evaluations of one SFT run (module docstring)."""

    def __init__(self, config: SFTConfig, run_dir: Path, world: World, num_steps: int) -> None:
        assert config.eval is not None
        self.config = config
        self.eval: SFTEvalConfig = config.eval
        self.run_dir = run_dir
        self.world = world
        self.num_steps = num_steps
        self.config_file = run_dir / "configs" / EVAL_CONFIG_FILE
        self.served = False
        if world.is_main:
            assert self.eval.inference_url, "sft sets eval.inference_url (or the user does)"
            self.config_file.parent.mkdir(parents=True, exist_ok=True)
            orchestrator = self.eval.orchestrator(config.model.name, config.seq_len)
            self.config_file.write_text(config_to_toml(orchestrator), encoding="utf-8")

    def is_due(self, step: int) -> bool:
        if step == 0:
            return self.eval.eval_base_model
        return step == self.num_steps and self.eval.eval_last_step or step % self.eval.interval == 0

    def evaluate(self, engine: Engine, step: int) -> dict[str, float]:
        """Evaluate the current weights as step `step` (collective); the metrics on rank 0."""
        state = engine.full_state_dict() if step > 0 else None
        metrics: dict[str, float] = {}
        if self.world.is_main:
            try:
                metrics = self.evaluate_on_main(step, state)
            except (OSError, httpx.HTTPError, subprocess.SubprocessError, EvalFailed) as error:
                log.warning("sft_eval_failed", step=step, error=str(error))
        dist.barrier()
        return metrics

    def evaluate_on_main(self, step: int, state: dict[str, Any] | None) -> dict[str, float]:
        self.wait_for_server()
        if state is not None:
            self.load_weights(step, state)
        out = eval_dir(self.run_dir, step)
        argv = [
            sys.executable,
            "-m",
            "rlbus_orchestrator.evaluate",
            str(self.config_file),
            *("--step", str(step), "--out", str(out)),
        ]
        started = time.perf_counter()
        done = subprocess.run(
            argv, capture_output=True, text=True, timeout=2 * self.eval.timeout_s, check=False
        )
        if done.returncode != 0:
            raise EvalFailed(f"the evaluation exited {done.returncode}: {done.stderr[-2000:]}")
        results = json.loads((out / EVAL_RESULTS_FILE).read_text(encoding="utf-8"))
        sink = JsonlEvalSink(self.run_dir)
        metrics: dict[str, float] = {}
        for env, env_metrics in results["envs"].items():
            sink.write_eval({"step": step, "time": time.time(), "env": env, **env_metrics})
            metrics |= env_metrics
        sink.close()
        log.info("sft_eval_done", step=step, seconds=round(time.perf_counter() - started, 1))
        return metrics

    def wait_for_server(self) -> None:
        if self.served:
            return
        url = str(self.eval.inference_url).rstrip("/") + "/models"
        deadline = time.monotonic() + SERVER_WAIT_S
        while time.monotonic() < deadline:
            try:
                if httpx.get(url, timeout=5).status_code == 200:
                    self.served = True
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        raise EvalFailed(f"the evaluation server {url} did not answer in {SERVER_WAIT_S:.0f} s")

    def load_weights(self, step: int, state: dict[str, Any]) -> None:
        """Write step `step`'s weights and load them into the server (module docstring, 1)."""
        root = broadcasts_dir(self.run_dir)
        # a whole model: a LoRA run's adapters folded into the weights
        out = write_model(state, self.config, root / f"step_{step}", merged=True)
        body = {
            "version": step,
            "path": str(out.resolve()),
            "sha256": {f.name: f.sha256 for f in weight_files(out)},
        }
        admin = str(self.eval.admin_url).rstrip("/")
        answer = httpx.post(f"{admin}/update_weights", json=body, timeout=self.eval.timeout_s)
        if answer.status_code != 200:
            raise EvalFailed(f"/update_weights answered {answer.status_code}: {answer.text[:500]}")
        for older in numbered_steps(root):
            if older < step:
                shutil.rmtree(root / f"step_{older}", ignore_errors=True)


class EvalFailed(Exception):
    """An evaluation that could not run or load its weights."""
