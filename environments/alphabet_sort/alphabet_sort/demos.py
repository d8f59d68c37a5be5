"""SFT demonstrations of alphabet-sort: whole episodes as `{"messages": [...]}` JSONL lines.

    python -m alphabet_sort.demos OUT.jsonl [--num 20000] [--lazy-fraction 0.4] [--seed 0]

Each line is one episode of the environment (same system prompt, same word generator, the
environment's messages as `user` turns) with the assistant's answers filled in. The answers are
of mixed quality, like SFT data from an unreliable teacher: each answer is, with probability
`lazy_fraction`, the lazy one (the previous answer with the new words appended, unsorted; on the
first turn the words as given) instead of the sorted one. A model trained on them sorts when it
answers greedily but often appends when it samples, which leaves RL a clear gain to make
(examples/alphabet-sort/README.md).

Episode `i` is drawn from `random.Random("alphabet-sort-demos/<seed>/<i>")`: the same file on
every machine, and no overlap in seeds with the environment's train or eval splits.
"""

import argparse
import json
import random
from pathlib import Path

from alphabet_sort.env import (
    NUM_TURNS,
    SYSTEM_PROMPT,
    WORD_LEN,
    WORDS_PER_TURN,
    AlphabetSortEnv,
    expected_answers,
)


def lazy_answer(previous: str, words: list[str]) -> str:
    """The previous answer with the new words appended as given (no merge)."""
    return " ".join([*previous.split(), *words])


def demonstration(
    env: AlphabetSortEnv, rng: random.Random, lazy_fraction: float
) -> list[dict[str, str]]:
    """One episode's messages, each answer sorted or (with probability `lazy_fraction`) lazy."""
    turns = env.generate(rng)
    messages = [{"role": "system", "content": SYSTEM_PROMPT}]
    answer = ""
    for words, right in zip(turns, expected_answers(turns), strict=True):
        answer = lazy_answer(answer, words) if rng.random() < lazy_fraction else right
        messages.append({"role": "user", "content": " ".join(words)})
        messages.append({"role": "assistant", "content": answer})
    return messages


def write_demos(
    path: Path, *, num: int, lazy_fraction: float, seed: int, env: AlphabetSortEnv
) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as out:
        for i in range(num):
            rng = random.Random(f"alphabet-sort-demos/{seed}/{i}")
            out.write(json.dumps({"messages": demonstration(env, rng, lazy_fraction)}) + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m alphabet_sort.demos", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("out", type=Path, help="JSONL file to write")
    parser.add_argument("--num", type=int, default=20000, help="episodes (default 20000)")
    parser.add_argument(
        "--lazy-fraction",
        type=float,
        default=0.4,
        help="share of answers that append the new words unsorted (default 0.4)",
    )
    parser.add_argument("--seed", type=int, default=0, help="data seed (default 0)")
    parser.add_argument("--num-turns", type=int, default=NUM_TURNS)
    parser.add_argument("--words-per-turn", type=int, default=WORDS_PER_TURN)
    parser.add_argument("--word-len", type=int, default=WORD_LEN)
    args = parser.parse_args(argv)
    if not 0.0 <= args.lazy_fraction <= 1.0:
        parser.error(f"--lazy-fraction must be in [0, 1], got {args.lazy_fraction}")
    env = AlphabetSortEnv(
        num_turns=args.num_turns, words_per_turn=args.words_per_turn, word_len=args.word_len
    )
    write_demos(args.out, num=args.num, lazy_fraction=args.lazy_fraction, seed=args.seed, env=env)
    print(f"{args.out}: {args.num} episodes, lazy_fraction {args.lazy_fraction}")


if __name__ == "__main__":
    main()
