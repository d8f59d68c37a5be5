"""`wordle`: guess a secret 3-letter word in a few turns, with per-letter feedback after each.

An episode (game):

    user:      "Guess the 3-letter word in 6 tries."
    assistant: "cat"
    user:      "c- aG t- | .a."    (this guess's marks | the letters placed so far: game.py)
    assistant: "pan"
    user:      "pG aG nG | pan"    (solved: the episode ends, this message is not trained on)

A guess is the assistant's text, stripped and lowercased. A guess that is not in the word list
(words.txt) is answered "not in list | <board>" and still uses its turn. The game ends when a guess is the
secret, or after `max_turns` guesses (a task's `EpisodeLimits.max_turns` wins over it).

Reward (each part is a component of the sample; `reward/<name>/mean` in the metrics):

    reward = 0.5 * solved + 0.2 * speed + 0.2 * greens + 0.1 * valid
    solved: 1 if a guess was the secret
    speed:  (max_turns - guesses) / (max_turns - 1) when solved (1 on the first guess, 0 on the
            last), else 0
    greens: the share of letters the last guess has in the right place (partial credit: a lost
            game that ended close to the secret scores above one that did not; 1 when solved)
    valid:  the share of guesses that are words of the list (the format part)

so a game solved in 3 of 6 guesses, all words, scores 0.5 + 0.12 + 0.2 + 0.1 = 0.92, and a lost
game of valid words 0.1 to ~0.23. Why the partial credit: the game is long for the tiny model
(~5.5 guesses, a quarter of its games solved after SFT), and with "solved" alone a group of games
on one secret often has no reward difference to learn from.

Data: the secrets are split once, independently of `seed`: a fixed shuffle of the word list
puts `eval_fraction` of the words in the eval split, the rest in train. The splits are disjoint so
that eval measures play on secrets the model never solved in training; every word of the list is
still a valid guess in both. Train example `i` draws its secret with `random.Random` seeded by
`(seed, "train", i)` (unbounded); eval example `i` is word `i` of the eval secrets in an order
seeded by `seed`, so an eval pass of `num_examples("eval")` games plays each eval secret once.
"""

import random
from typing import Any

from rlbus.wire.tasks import ChatMessage, Problem
from rlbus_orchestrator.envs.base import Score, Split
from rlbus_orchestrator.envs.multiturn import MultiTurnEnv, Reply
from rlbus_wordle.game import GREEN, feedback, known_letters, render_feedback, word_list

DEFAULT_MAX_TURNS = 6
NOT_IN_LIST = "not in list"
SPLIT_SEED = "rlbus-wordle/split"
REWARD_WEIGHTS = {"solved": 0.5, "speed": 0.2, "greens": 0.2, "valid": 0.1}


def prompt(word_length: int, max_turns: int) -> str:
    """The first message. Short: every token of it is computed on each turn of a game, and the
    marks are the same in every game, so a model learns them from the feedback itself."""
    return f"Guess the {word_length}-letter word in {max_turns} tries."


def split_secrets(words: tuple[str, ...], eval_fraction: float) -> dict[str, list[str]]:
    """Train and eval secrets: a fixed shuffle of `words`, the first `eval_fraction` for eval."""
    shuffled = list(words)
    random.Random(SPLIT_SEED).shuffle(shuffled)
    num_eval = max(1, round(len(words) * eval_fraction))
    return {"eval": sorted(shuffled[:num_eval]), "train": sorted(shuffled[num_eval:])}


def parse_guess(text: str) -> str:
    return text.strip().lower()


def reply_to(guesses: list[str], secret: str, words: tuple[str, ...]) -> str:
    """The environment's message after the last of `guesses`: its marks (NOT_IN_LIST for a word
    off the list), then the board of letters placed so far, `c- aG t- | .a.`."""
    last = guesses[-1]
    marks = render_feedback(last, feedback(last, secret)) if last in words else NOT_IN_LIST
    history = [(g, feedback(g, secret)) for g in guesses if g in words]
    return f"{marks} | {known_letters(history, len(secret))}"


def game_score(guesses: list[str], secret: str, words: tuple[str, ...], max_turns: int) -> Score:
    """The reward of a game of `guesses` (module docstring)."""
    solved = secret in guesses
    speed = max(0.0, (max_turns - len(guesses)) / max(1, max_turns - 1)) if solved else 0.0
    last = guesses[-1] if guesses else ""
    greens = feedback(last, secret).count(GREEN) / len(secret) if last in words else 0.0
    valid = sum(g in words for g in guesses) / len(guesses) if guesses else 0.0
    parts = {"solved": float(solved), "speed": speed, "greens": greens, "valid": valid}
    reward = sum(REWARD_WEIGHTS[name] * value for name, value in parts.items())
    return Score(
        reward=reward,
        components={**parts, "guesses": float(len(guesses))},
        completion_text=" ".join(guesses),
    )


class WordleEnv(MultiTurnEnv):
    """The word-guessing game (module docstring)."""

    env_id = "wordle"
    max_turns = DEFAULT_MAX_TURNS

    def __init__(
        self,
        *,
        seed: int = 0,
        max_turns: int = DEFAULT_MAX_TURNS,
        eval_fraction: float = 0.2,
        num_eval: int | None = None,
    ) -> None:
        if max_turns < 1:
            raise ValueError(f"wordle: max_turns must be >= 1, got {max_turns}")
        if not 0.0 < eval_fraction < 1.0:
            raise ValueError(f"wordle: eval_fraction must be in (0, 1), got {eval_fraction}")
        self.seed, self.max_turns, self.num_eval = seed, max_turns, num_eval
        self.words = word_list()
        self.secrets = split_secrets(self.words, eval_fraction)
        self.prompt = prompt(len(self.words[0]), max_turns)

    def num_examples(self, split: Split) -> int | None:
        if split == "train":
            return None
        return self.num_eval if self.num_eval is not None else len(self.secrets["eval"])

    def secret(self, split: Split, index: int) -> str:
        """The secret of example `index` of `split` (module docstring)."""
        if split == "train":
            return random.Random(f"wordle/{self.seed}/train/{index}").choice(self.secrets["train"])
        order = list(self.secrets["eval"])
        random.Random(f"wordle/{self.seed}/eval").shuffle(order)
        return order[index % len(order)]

    def example(self, split: Split, index: int) -> Problem:
        secret = self.secret(split, index)
        return Problem(
            messages=[ChatMessage(role="user", content=self.prompt)],
            answer=secret,
            info={"secret": secret},
        )

    async def respond(
        self, problem: Problem, conversation: list[dict[str, Any]], state: dict[str, Any]
    ) -> Reply:
        guesses = [parse_guess(m["content"]) for m in conversation if m["role"] == "assistant"]
        secret = problem.info["secret"]
        message = {"role": "user", "content": reply_to(guesses, secret, self.words)}
        return Reply(messages=[message], done=guesses[-1] == secret)

    async def score(
        self, problem: Problem, conversation: list[dict[str, Any]], state: dict[str, Any]
    ) -> Score:
        guesses = [parse_guess(m["content"]) for m in conversation if m["role"] == "assistant"]
        return game_score(guesses, problem.info["secret"], self.words, self.max_turns)
