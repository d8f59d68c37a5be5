"""SFT demonstrations of wiki-search: whole episodes as `{"messages": [...]}` JSONL lines.

    python -m wiki_search.demos OUT.jsonl [--num 3200] [--seed 0] [--guess 0.1] ...

Each line is one episode as the environment plays it (its system prompt and questions, the tool
calls as the literal hermes text the model must learn to write, the tools' real answers as `tool`
messages, then the one-word answer). The pages come from practice corpora (`generate_pages` with
seeds of their own, a new one every `DEMOS_PER_CORPUS` episodes), never the shipped one: the
model learns to look facts up, not the facts RL asks about.

The demonstrations are of mixed quality, like SFT data from an unreliable teacher, so the SFT
model samples the right behaviour often but not reliably, and RL has a clear gain to make
(examples/wiki-search/README.md). Independently per episode:

- `guess`: no tools at all, a random value of the asked fact (right by chance ~1 in 9);
- `typo`: one letter of the name in the search query is wrong (search usually still ranks the
  right page first: the closest title);
- `second_hit`: the second search result is opened instead of the first (a wrong page);
- `wrong_fact`: another fact of the opened page is answered (the color for the food, ...).

Episode `i` is drawn from `random.Random("wiki-search-demos/<seed>/<i>")`: the same file on every
machine.
"""

import argparse
import json
import random
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from wiki_search.corpus import ATTRIBUTES, COLORS, FOODS, HOMES, Corpus, generate_pages
from wiki_search.env import SYSTEM_PROMPT, question_text

DEMOS_PER_CORPUS = 50
CHOICES = {"color": COLORS, "home": HOMES, "food": FOODS}
"""What a guess picks from, per fact."""


@dataclass
class Noise:
    """How often each mistake is made (module docstring)."""

    guess: float = 0.1
    typo: float = 0.1
    second_hit: float = 0.2
    wrong_fact: float = 0.15


def tool_call_text(name: str, arguments: dict[str, Any]) -> str:
    """A tool call as the model writes it (the hermes format vLLM's `hermes` parser reads)."""
    call = json.dumps({"name": name, "arguments": arguments}, separators=(",", ":"))
    return f"<tool_call>{call}</tool_call>"


@lru_cache(maxsize=4)
def practice_corpus(seed: int, block: int) -> Corpus:
    return Corpus(generate_pages(f"demos-{seed}-{block}"))


def misspelled(name: str, rng: random.Random) -> str:
    i = rng.randrange(1, len(name))
    letter = rng.choice([c for c in "abdeiklmnorstuvz" if c != name[i]])
    return name[:i] + letter + name[i + 1 :]


def demonstration(corpus: Corpus, rng: random.Random, noise: Noise) -> list[dict[str, str]]:
    """One episode's messages about a random page and fact of `corpus`."""
    page = rng.choice(sorted(corpus.pages.values(), key=lambda p: p.id))
    attribute = rng.choice(ATTRIBUTES)
    messages = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": question_text(page, attribute)},
    ]
    if rng.random() < noise.guess:
        guess = rng.choice(CHOICES[attribute])
        return [*messages, {"role": "assistant", "content": guess}]
    query = misspelled(page.title, rng) if rng.random() < noise.typo else page.title
    hits = corpus.search(query)
    ids = [line.split()[0] for line in hits.splitlines()]
    opened = ids[1] if len(ids) > 1 and rng.random() < noise.second_hit else ids[0]
    found = corpus.pages[opened]
    asked = attribute
    if rng.random() < noise.wrong_fact:
        asked = rng.choice([a for a in ATTRIBUTES if a != attribute])
    return [
        *messages,
        {"role": "assistant", "content": tool_call_text("search", {"query": query})},
        {"role": "tool", "content": hits},
        {"role": "assistant", "content": tool_call_text("open", {"id": opened})},
        {"role": "tool", "content": corpus.open(opened)},
        {"role": "assistant", "content": found.fact(asked)},
    ]


def write_demos(path: Path, *, num: int, seed: int, noise: Noise) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as out:
        for i in range(num):
            rng = random.Random(f"wiki-search-demos/{seed}/{i}")
            corpus = practice_corpus(seed, i // DEMOS_PER_CORPUS)
            out.write(json.dumps({"messages": demonstration(corpus, rng, noise)}) + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m wiki_search.demos", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("out", type=Path, help="JSONL file to write")
    parser.add_argument("--num", type=int, default=3200, help="episodes (default 3200)")
    parser.add_argument("--seed", type=int, default=0, help="seed (default 0)")
    defaults = Noise()
    for name in ("guess", "typo", "second_hit", "wrong_fact"):
        parser.add_argument(
            f"--{name.replace('_', '-')}",
            type=float,
            default=getattr(defaults, name),
            help=f"share of episodes with this mistake (default {getattr(defaults, name)})",
        )
    args = parser.parse_args(argv)
    noise = Noise(args.guess, args.typo, args.second_hit, args.wrong_fact)
    write_demos(args.out, num=args.num, seed=args.seed, noise=noise)
    print(args.out)


if __name__ == "__main__":
    main()
