"""alphabet-sort: each turn the environment adds words, and the model answers with every word
so far in alphabetical order.

An episode with the defaults (3 turns of 2 one-letter words):

    system:    Sort all words so far alphabetically.
    user:      k b                 turn 1: the first words
    assistant: b k
    user:      d z                 turn 2: more words
    assistant: b d k z             every word so far, sorted
    user:      p h
    assistant: b d h k p z

and with `word_len = 3`: `kel bam` -> `bam kel`, `dor zif` -> `bam dor kel zif`, ... The episode
ends after the model's answer to its last turn (`Reply(done=True)`), so it has exactly as many
model turns as the environment has turns unless a limit cuts it short.

prime-rl's alphabet-sort arguments work too: `min_turns`/`max_turns` (turns per episode, drawn
per episode) and `min_names_per_turn`/`max_names_per_turn` (words per turn, drawn per turn) in
place of the fixed `num_turns` and `words_per_turn`; `similarity_power` and `power_per_turn`
shape the reward (below).

Data is generated: episode `i` of a split is drawn from `random.Random` seeded with
`(seed, split, i)`, so any data cursor resumes without state and the splits never share a seed.
The words of an episode are distinct lowercase strings of `word_len` letters; with
`distinct_initials` (the default) they also start with distinct letters, so the order depends on
the first letter alone. Without it, ties are broken by the later letters, as in any dictionary.
The defaults are what the tiny 2-layer byte-level model of examples/alphabet-sort learns in
minutes on 2 CPU cores: with 3-letter words it had learnt nothing past the format after 160 SFT
steps (each answer's letters still at chance), with one-letter words it sorted (greedy reward
0.94) after 400.

Reward: each turn's answer is compared with the sorted words so far, both as words joined by
single spaces: `difflib.SequenceMatcher(None, answer, expected).ratio()` (1 = exact, partial
credit for a partly right order or a misspelt word). The episode's reward is the mean over the
episode's turns, a turn never answered counting 0. The mean rather than the last turn alone:
every answer is sampled and trained on, so every answer should count, and an episode cut short
(a turn cut at `max_tokens`, an episode limit) scores below a finished one. With
`similarity_power = p` (default 1) each turn's ratio is raised to `p` before the mean
(`power_per_turn = false`: the mean is), which, as in prime-rl, leaves little credit for an
almost-right order: at p = 4 a ratio of 0.8 earns 0.41. Components: `similarity` (the mean
ratio, before the power), `final` (the last turn's ratio, 0 when it was never answered) and
`exact` (the share of turns answered exactly).
"""

import difflib
import itertools
import random
import string
from typing import Any

from rlbus.wire.tasks import ChatMessage, Problem
from rlbus_orchestrator.envs.base import Score, Split
from rlbus_orchestrator.envs.multiturn import MultiTurnEnv, Reply

ENV_ID = "alphabet-sort"
SYSTEM_PROMPT = "Sort all words so far alphabetically."
ALPHABET = string.ascii_lowercase
NUM_TURNS, WORDS_PER_TURN, WORD_LEN = 3, 2, 1
"""The defaults (see module docstring)."""


def make_turns(
    rng: random.Random,
    *,
    turn_sizes: list[int],
    word_len: int,
    distinct_initials: bool,
) -> list[list[str]]:
    """The words each turn adds: one list of `turn_sizes[i]` distinct words per turn."""
    num_words = sum(turn_sizes)
    words: list[str] = []
    if distinct_initials:
        for initial in rng.sample(ALPHABET, num_words):
            words.append(initial + "".join(rng.choices(ALPHABET, k=word_len - 1)))
    else:
        while len(words) < num_words:
            word = "".join(rng.choices(ALPHABET, k=word_len))
            if word not in words:
                words.append(word)
    bounds = list(itertools.accumulate(turn_sizes, initial=0))
    return [words[a:b] for a, b in itertools.pairwise(bounds)]


def expected_answers(turns: list[list[str]]) -> list[str]:
    """The right answer of each turn: every word so far, sorted, joined by spaces."""
    so_far: list[str] = []
    answers = []
    for words in turns:
        so_far += words
        answers.append(" ".join(sorted(so_far)))
    return answers


def normalized(answer: str) -> str:
    """An answer's words joined by single spaces (how it is compared)."""
    return " ".join(answer.split())


def turn_similarity(answer: str, expected: str) -> float:
    """How close one answer is to the right one (1 = exact)."""
    return difflib.SequenceMatcher(None, normalized(answer), expected).ratio()


def episode_score(
    answers: list[str], turns: list[list[str]], *, power: float = 1.0, per_turn: bool = True
) -> Score:
    """The reward of an episode's answers, in turn order (see module docstring)."""
    expected = expected_answers(turns)
    ratios = [turn_similarity(a, e) for a, e in zip(answers, expected, strict=False)]
    ratios += [0.0] * (len(expected) - len(ratios))
    num_exact = sum(normalized(a) == e for a, e in zip(answers, expected, strict=False))
    similarity = sum(ratios) / len(ratios)
    if per_turn:
        reward = sum(r**power for r in ratios) / len(ratios)
    else:
        reward = similarity**power
    final = normalized(answers[-1]) if answers else ""
    return Score(
        reward=reward,
        components={
            "similarity": similarity,
            "final": ratios[-1],
            "exact": num_exact / len(ratios),
        },
        completion_text=final,
    )


def prompt_messages(first_words: list[str]) -> list[ChatMessage]:
    return [
        ChatMessage(role="system", content=SYSTEM_PROMPT),
        ChatMessage(role="user", content=" ".join(first_words)),
    ]


class AlphabetSortEnv(MultiTurnEnv):
    """The alphabet-sort environment (see module docstring)."""

    env_id = ENV_ID

    def __init__(
        self,
        *,
        num_turns: int = NUM_TURNS,
        words_per_turn: int = WORDS_PER_TURN,
        word_len: int = WORD_LEN,
        distinct_initials: bool = True,
        min_turns: int | None = None,
        max_turns: int | None = None,
        min_names_per_turn: int | None = None,
        max_names_per_turn: int | None = None,
        similarity_power: float = 1.0,
        power_per_turn: bool = True,
        num_eval: int = 256,
        num_train: int | None = None,
        seed: int = 0,
    ) -> None:
        # prime-rl's ranges; a bound not given is num_turns / words_per_turn, kept inside the
        # other bound
        self.max_episode_turns = max(num_turns, min_turns or 1) if max_turns is None else max_turns
        self.min_turns = min(num_turns, self.max_episode_turns) if min_turns is None else min_turns
        self.max_words = (
            max(words_per_turn, min_names_per_turn or 1)
            if max_names_per_turn is None
            else max_names_per_turn
        )
        self.min_words = (
            min(words_per_turn, self.max_words)
            if min_names_per_turn is None
            else min_names_per_turn
        )
        if min(self.min_turns, self.min_words, word_len) < 1:
            raise ValueError(
                f"{ENV_ID}: turns, words per turn and word_len must be >= 1, got "
                f"min_turns={self.min_turns} min_names_per_turn={self.min_words} "
                f"word_len={word_len}"
            )
        if self.min_turns > self.max_episode_turns or self.min_words > self.max_words:
            raise ValueError(
                f"{ENV_ID}: min_turns <= max_turns and min_names_per_turn <= max_names_per_turn "
                f"are needed, got turns {self.min_turns}..{self.max_episode_turns}, words per "
                f"turn {self.min_words}..{self.max_words}"
            )
        most_words = self.max_episode_turns * self.max_words
        if distinct_initials and most_words > len(ALPHABET):
            raise ValueError(
                f"{ENV_ID}: distinct_initials needs turns * words per turn <= "
                f"{len(ALPHABET)}, got up to {most_words}; set distinct_initials = false "
                "or use fewer words"
            )
        if similarity_power <= 0:
            raise ValueError(f"{ENV_ID}: similarity_power must be > 0, got {similarity_power}")
        self.num_turns, self.words_per_turn, self.word_len = num_turns, words_per_turn, word_len
        self.distinct_initials = distinct_initials
        self.similarity_power, self.power_per_turn = similarity_power, power_per_turn
        self.num_eval, self.num_train, self.seed = num_eval, num_train, seed
        # the limit when a task carries none: the longest episode
        self.max_turns = self.max_episode_turns

    def num_examples(self, split: Split) -> int | None:
        return self.num_eval if split == "eval" else self.num_train

    def turns(self, split: str, index: int) -> list[list[str]]:
        """The words of each turn of example `index` of `split`."""
        if self.num_train is not None and split == "train":
            index %= self.num_train
        return self.generate(random.Random(f"{ENV_ID}/{self.seed}/{split}/{index}"))

    def generate(self, rng: random.Random) -> list[list[str]]:
        """An episode's turns; the number of turns and of words per turn are drawn only where
        they vary (so fixed ones draw the same words as before those ranges existed)."""
        num_turns = self.min_turns
        if self.max_episode_turns > self.min_turns:
            num_turns = rng.randint(self.min_turns, self.max_episode_turns)
        sizes = [self.min_words] * num_turns
        if self.max_words > self.min_words:
            sizes = [rng.randint(self.min_words, self.max_words) for _ in range(num_turns)]
        return make_turns(
            rng, turn_sizes=sizes, word_len=self.word_len, distinct_initials=self.distinct_initials
        )

    def example(self, split: Split, index: int) -> Problem:
        turns = self.turns(split, index)
        return Problem(
            messages=prompt_messages(turns[0]),
            answer=expected_answers(turns)[-1],
            info={"turns": turns},
        )

    async def respond(
        self, problem: Problem, conversation: list[dict[str, Any]], state: dict[str, Any]
    ) -> Reply:
        turns = problem.info["turns"]
        num_answered = sum(m["role"] == "assistant" for m in conversation)
        if num_answered >= len(turns):
            return Reply(done=True)
        return Reply(messages=[{"role": "user", "content": " ".join(turns[num_answered])}])

    async def score(
        self, problem: Problem, conversation: list[dict[str, Any]], state: dict[str, Any]
    ) -> Score:
        answers = [m["content"] for m in conversation if m["role"] == "assistant"]
        return episode_score(
            answers,
            problem.info["turns"],
            power=self.similarity_power,
            per_turn=self.power_per_turn,
        )
