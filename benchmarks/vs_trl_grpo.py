"""TRL's side of benchmarks/vs_trl.py: GRPOTrainer on a job file, one JSON line per trained step.

    <trl venv>/bin/python benchmarks/vs_trl_grpo.py JOB.json STEPS.jsonl T0

Runs in the separate TRL venv that vs_trl.py makes, so it imports nothing from rlbus: everything
that must match the rlbus run (model, prompts and their answers, samples per step, sampling and
optimizer settings) comes in JOB.json, written by vs_trl.py from the resolved `rl` config. Each
line of STEPS.jsonl: `step`, `elapsed_s` (wall time of the step's end since the unix time
vs_trl.py started this process, passed as T0), `step_s` (the step's own time, generation included) and
`reward` (mean reward of the step's sampled completions, as TRL logs it).
"""

import difflib
import json
import sys
import time

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer


def reverse_reward(completions, answer, **_) -> list[float]:
    """The reverse-text reward; same formula as rlbus_orchestrator.envs.reverse_text.reverse_reward
    (its home), applied to the stripped answer like the environment does."""
    return [
        difflib.SequenceMatcher(None, c[0]["content"].strip(), a).ratio()
        for c, a in zip(completions, answer, strict=True)
    ]


class StepLog(TrainerCallback):
    """Appends one line per optimizer step (written at the step's log, timed at its end)."""

    def __init__(self, path: str, t0: float):
        self.out = open(path, "a")  # closed at train end
        self.t0, self.begin, self.end = t0, 0.0, 0.0

    def on_step_begin(self, args, state, control, **kwargs):
        self.begin = time.time()

    def on_step_end(self, args, state, control, **kwargs):
        self.end = time.time()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "reward" in logs:
            row = {
                "step": state.global_step,
                "elapsed_s": self.end - self.t0,
                "step_s": self.end - self.begin,
                "reward": logs["reward"],
            }
            self.out.write(json.dumps(row) + "\n")
            self.out.flush()

    def on_train_end(self, args, state, control, **kwargs):
        self.out.close()


def grpo_config(job: dict) -> GRPOConfig:
    """One optimizer step = `prompts_per_step` x `num_generations` samples, like rlbus's batch."""
    return GRPOConfig(
        output_dir=job["output_dir"],
        max_steps=job["max_steps"],
        per_device_train_batch_size=job["prompts_per_step"] * job["num_generations"],
        gradient_accumulation_steps=1,
        num_generations=job["num_generations"],
        max_completion_length=job["max_completion_length"],
        temperature=job["temperature"],
        top_p=job["top_p"],
        learning_rate=job["lr"],
        lr_scheduler_type="constant",
        optim="adamw_torch",
        weight_decay=job["weight_decay"],
        adam_beta1=job["betas"][0],
        adam_beta2=job["betas"][1],
        adam_epsilon=job["eps"],
        max_grad_norm=job["max_norm"],
        beta=job["kl_beta"],
        scale_rewards=job["scale_rewards"],
        loss_type="dapo",
        shuffle_dataset=False,
        gradient_checkpointing=False,
        use_cpu=True,
        bf16=False,
        fp16=False,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=job["seed"],
        disable_tqdm=True,
    )


def main() -> None:
    job_path, steps_path, t0 = sys.argv[1], sys.argv[2], float(sys.argv[3])
    job = json.loads(open(job_path).read())
    tokenizer = AutoTokenizer.from_pretrained(job["model"])
    model = AutoModelForCausalLM.from_pretrained(job["model"], dtype=torch.float32)
    trainer = GRPOTrainer(
        model=model,
        processing_class=tokenizer,
        reward_funcs=reverse_reward,
        args=grpo_config(job),
        train_dataset=Dataset.from_list(job["examples"]),
        callbacks=[StepLog(steps_path, t0)],
    )
    trainer.train()


if __name__ == "__main__":
    main()
