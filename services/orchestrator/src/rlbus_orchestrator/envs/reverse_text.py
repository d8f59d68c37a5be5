"""Built-in `reverse-text`: reverse a short text character by character.

Data is generated locally and deterministically: example `i` of a split is drawn from a
`random.Random` seeded with `(seed, split, i)`, so any cursor can be resumed without state and the
train and eval splits never share a seed. The prompt is deliberately plain so that a tiny
character-level model can learn it:

    system: "Reverse the text character by character."
    user:   "<text>"
    answer: "<text reversed>"

Reward: `difflib.SequenceMatcher(None, answer, reversed_text).ratio()` (in [0, 1]; 1 = exact).
"""

import difflib
import random
import string

from rlbus.wire.tasks import ChatMessage, Problem
from rlbus_orchestrator.envs.base import ChatTurn, Score, SingleTurnEnv, Split

SYSTEM_PROMPT = "Reverse the text character by character."
DEFAULT_ALPHABET = string.ascii_lowercase


def make_text(rng: random.Random, min_len: int, max_len: int, alphabet: str) -> str:
    """A random text of `min_len..max_len` characters from `alphabet`."""
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(min_len, max_len)))


def make_messages(text: str) -> list[ChatMessage]:
    """The chat prompt asking to reverse `text`."""
    return [
        ChatMessage(role="system", content=SYSTEM_PROMPT),
        ChatMessage(role="user", content=text),
    ]


def reverse_reward(answer: str, text: str) -> float:
    """Longest-common-subsequence style ratio between the answer and the reversed text."""
    return difflib.SequenceMatcher(None, answer, text[::-1]).ratio()


class ReverseTextEnv(SingleTurnEnv):
    """The reverse-text environment (see module docstring)."""

    env_id = "reverse-text"

    def __init__(
        self,
        *,
        min_len: int = 5,
        max_len: int = 10,
        alphabet: str = DEFAULT_ALPHABET,
        num_eval: int = 256,
        num_train: int | None = None,
        seed: int = 0,
    ) -> None:
        if not 1 <= min_len <= max_len:
            raise ValueError(
                f"reverse-text: need 1 <= min_len <= max_len, got min_len={min_len} max_len={max_len}"
            )
        if not alphabet:
            raise ValueError("reverse-text: alphabet must not be empty")
        self.min_len, self.max_len, self.alphabet = min_len, max_len, alphabet
        self.num_eval, self.num_train, self.seed = num_eval, num_train, seed

    def num_examples(self, split: Split) -> int | None:
        return self.num_eval if split == "eval" else self.num_train

    def text(self, split: Split, index: int) -> str:
        """The text of example `index` of `split`."""
        if self.num_train is not None and split == "train":
            index %= self.num_train
        rng = random.Random(f"reverse-text/{self.seed}/{split}/{index}")
        return make_text(rng, self.min_len, self.max_len, self.alphabet)

    def example(self, split: Split, index: int) -> Problem:
        text = self.text(split, index)
        return Problem(messages=make_messages(text), answer=text[::-1], info={"text": text})

    async def score(self, problem: Problem, turn: ChatTurn) -> Score:
        answer = turn.text.strip()
        reward = reverse_reward(answer, problem.info["text"])
        return Score(reward=reward, components={"lcs_ratio": reward}, completion_text=answer)
