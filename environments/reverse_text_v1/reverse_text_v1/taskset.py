"""reverse-text written against `verifiers.v1`: a generated string, reversed by the model.

Task `i` is drawn from `random.Random("reverse-text-v1/<seed>/<i>")`, so a row is the same on
every machine and the rlbus side can address rows by index. The reward is
`difflib.SequenceMatcher` similarity between the reply and the reversed text, as in rlbus's
built-in `reverse-text`.
"""

import difflib
import random
import string

import verifiers.v1 as vf

SYSTEM_PROMPT = "Reverse the text character by character."


class ReverseTextData(vf.TaskData):
    """One row: the text to reverse and its reversal."""

    answer: str


class ReverseTextTask(vf.Task[ReverseTextData]):
    @vf.reward(weight=1.0)
    async def lcs_ratio(self, trace: vf.Trace) -> float:
        return difflib.SequenceMatcher(None, trace.last_reply, self.data.answer).ratio()


class ReverseTextConfig(vf.TasksetConfig):
    num_tasks: int = 256
    """How many tasks `load()` yields."""
    min_len: int = 5
    """Shortest text."""
    max_len: int = 10
    """Longest text."""
    seed: int = 0
    """Seed of the generated texts."""


def make_text(seed: int, index: int, min_len: int, max_len: int) -> str:
    """The text of task `index` (deterministic)."""
    rng = random.Random(f"reverse-text-v1/{seed}/{index}")
    return "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(min_len, max_len)))


class ReverseTextTaskset(vf.Taskset[ReverseTextTask, ReverseTextConfig]):
    def load(self) -> list[ReverseTextTask]:
        c = self.config
        tasks = []
        for i in range(c.num_tasks):
            text = make_text(c.seed, i, c.min_len, c.max_len)
            data = ReverseTextData(prompt=text, system_prompt=SYSTEM_PROMPT, answer=text[::-1])
            tasks.append(ReverseTextTask(data, c.task))
        return tasks
