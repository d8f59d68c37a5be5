"""Small message factories and a wait shared by the bus integration tests."""

import asyncio
import time

from rlbus.wire import batches, tasks


async def wait_for(predicate, timeout_s: float, interval_s: float = 0.05) -> None:
    """Poll `predicate` until it holds; fail the test after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(interval_s)


def make_task(index: int, step: int = 0) -> tasks.Task:
    return tasks.Task(
        task_id=f"{step}-{index}",
        step=step,
        env_id="reverse-text",
        problem=tasks.Problem(messages=[tasks.ChatMessage(role="user", content=f"text {index}")]),
    )


def make_batch(step: int, num_tokens: int = 8) -> batches.TrainBatch:
    micro = batches.MicroBatch(
        input_ids=list(range(num_tokens)),
        position_ids=list(range(num_tokens)),
        loss_mask=[1] * num_tokens,
        advantages=[0.5] * num_tokens,
        inference_logprobs=[-0.1] * num_tokens,
        temperatures=[1.0] * num_tokens,
        seq_lens=[num_tokens],
    )
    return batches.TrainBatch(step=step, micro_batches=[[micro]], num_tokens=num_tokens)
