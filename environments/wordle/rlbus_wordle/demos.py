"""Demonstration games for SFT: `python -m rlbus_wordle.demos OUT.jsonl [--num-games N ...]`.

Each line is `{"messages": [...]}`, one game on a train secret, with the prompt and feedback the
environment writes (env.WordleEnv), so a model trained on it starts RL on exactly the text it
learned. The player is a simple solver: each guess is drawn uniformly from the words still
consistent with all feedback so far (game.candidates). The demonstrations are of mixed quality
on purpose, so that the SFT model plays the game but not always well and RL has a gain to make
(examples/wordle/README.md):

- with probability `weak_fraction` per turn the player guesses any word of the list it has not
  guessed yet, ignoring the feedback;
- with probability `sloppy_fraction` per turn it writes its guess with a trailing `?` (`cat?`),
  which is not a word of the list: the environment answers "not in list" and the turn is lost
  (the guess counts again as unguessed).

A game ends when solved or after `max_turns` guesses.

Game `i` is seeded by `(seed, i)`: the same arguments write the same file.
"""

import argparse
import json
import random
from pathlib import Path

from rlbus_wordle.env import WordleEnv, reply_to
from rlbus_wordle.game import candidates, feedback


def play_game(
    env: WordleEnv, index: int, rng: random.Random, weak_fraction: float, sloppy_fraction: float
) -> list[dict[str, str]]:
    """One demonstration game on train example `index` (module docstring)."""
    problem = env.example("train", index)
    assert problem.messages is not None and problem.answer is not None
    secret = problem.answer
    messages = [{"role": m.role, "content": m.content} for m in problem.messages]
    history: list[tuple[str, str]] = []
    guesses: list[str] = []  # as written, the sloppy ones included
    for _ in range(env.max_turns):
        guessed = {g for g, _ in history}
        if rng.random() < weak_fraction:
            guess = rng.choice([w for w in env.words if w not in guessed])
        else:
            guess = rng.choice(candidates(env.words, history))
        if rng.random() < sloppy_fraction:
            guess += "?"
        messages.append({"role": "assistant", "content": guess})
        guesses.append(guess)
        if guess == secret:
            break
        if guess in env.words:
            history.append((guess, feedback(guess, secret)))
        messages.append({"role": "user", "content": reply_to(guesses, secret, env.words)})
    if messages[-1]["role"] == "user":
        messages.pop()  # the feedback after the last guess of a lost game asks for no answer
    return messages


def demo_games(
    num_games: int,
    *,
    seed: int = 0,
    weak_fraction: float = 0.2,
    sloppy_fraction: float = 0.25,
    max_turns: int = 6,
) -> list[list[dict[str, str]]]:
    env = WordleEnv(seed=seed, max_turns=max_turns)
    return [
        play_game(env, i, random.Random(f"wordle-demos/{seed}/{i}"), weak_fraction, sloppy_fraction)
        for i in range(num_games)
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m rlbus_wordle.demos", description=__doc__.splitlines()[0]
    )
    parser.add_argument("out", type=Path, help="JSONL file to write")
    parser.add_argument("--num-games", type=int, default=4000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--weak-fraction",
        type=float,
        default=0.2,
        help="share of guesses that ignore the feedback (default 0.2)",
    )
    parser.add_argument(
        "--sloppy-fraction",
        type=float,
        default=0.25,
        help="share of guesses written with a trailing '?', which the game refuses (default 0.25)",
    )
    parser.add_argument("--max-turns", type=int, default=6)
    args = parser.parse_args(argv)
    games = demo_games(
        args.num_games,
        seed=args.seed,
        weak_fraction=args.weak_fraction,
        sloppy_fraction=args.sloppy_fraction,
        max_turns=args.max_turns,
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w") as f:
        for messages in games:
            f.write(json.dumps({"messages": messages}) + "\n")
    num_guesses = sum(m["role"] == "assistant" for game in games for m in game)
    print(f"wrote {len(games)} games ({num_guesses / len(games):.2f} guesses each) to {args.out}")


if __name__ == "__main__":
    main()
