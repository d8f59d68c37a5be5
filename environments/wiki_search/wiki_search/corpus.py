"""The encyclopedia: short made-up pages, one animal each, and the two things a reader can do.

A page is one animal of an invented world, in one sentence pattern a character-level model can
read:

    #42  Zorbix  "Zorbix is a blue fox from Kell. It eats figs."

`Corpus.search(query)` lists the ids and titles of the best matching pages, one per line
(`#42 Zorbix`): a query word equal to a title counts most, one found in a page's text next, and
the closest title by letter trigrams breaks ties and catches a misspelled name (so a bad query
still finds something, often the wrong page). `Corpus.open(id)` returns a page's text.

Pages are generated from a seed (`generate_pages`): the shipped corpus (`pages.jsonl` next to this
file) is seed 0, written by `python -m wiki_search.corpus`; demonstrations use other seeds, so a
model taught by them has learned how to look facts up, not the facts of the shipped pages.
"""

import json
import random
import re
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

PAGES_PATH = Path(__file__).with_name("pages.jsonl")
NUM_PAGES = 100
ATTRIBUTES = ("color", "home", "food")
"""The facts a question asks about (every page has each)."""

ONSETS = ("b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "dr", "gr")
VOWELS = ("a", "e", "i", "o", "u")
INNER_CODAS = ("", "", "r", "l", "n", "s")
FINAL_CODAS = ("", "n", "r", "x", "k", "l", "m", "s")
KINDS = ("fox", "owl", "cat", "bear", "wolf", "hare", "crab", "frog")
COLORS = ("red", "blue", "green", "gold", "gray", "pink", "black", "white")
HOMES = ("Kell", "Dorn", "Ashby", "Mirel", "Tusk", "Oram", "Velt", "Brisk", "Hollin", "Sarn")
FOODS = ("figs", "nuts", "fish", "corn", "plums", "seeds", "honey", "moss")
NO_RESULTS = "no results"


@dataclass(frozen=True)
class Page:
    """One page: an animal with a kind and three facts (`ATTRIBUTES`)."""

    id: str
    title: str
    kind: str
    color: str
    home: str
    food: str

    @property
    def text(self) -> str:
        return f"{self.title} is a {self.color} {self.kind} from {self.home}. It eats {self.food}."

    def fact(self, attribute: str) -> str:
        """The value of one of `ATTRIBUTES`."""
        assert attribute in ATTRIBUTES, attribute
        return str(getattr(self, attribute))


def make_name(rng: random.Random) -> str:
    """A made-up two-syllable name (`Zorbix`, `Tela`, `Brunok`)."""
    first = rng.choice(ONSETS) + rng.choice(VOWELS) + rng.choice(INNER_CODAS)
    second = rng.choice(ONSETS) + rng.choice(VOWELS) + rng.choice(FINAL_CODAS)
    return (first + second).capitalize()


def generate_pages(seed: int | str = 0, num_pages: int = NUM_PAGES) -> list["Page"]:
    """`num_pages` pages with distinct titles, ids `#00`.. in a shuffled order (an id says nothing
    about its page), deterministic per seed."""
    rng = random.Random(f"wiki-search-pages/{seed}")
    titles: list[str] = []
    while len(titles) < num_pages:
        name = make_name(rng)
        if name not in titles and 4 <= len(name) <= 7:
            titles.append(name)
    width = len(str(num_pages - 1))
    numbers = list(range(num_pages))
    rng.shuffle(numbers)
    pages = [
        Page(
            id=f"#{number:0{width}d}",
            title=title,
            kind=rng.choice(KINDS),
            color=rng.choice(COLORS),
            home=rng.choice(HOMES),
            food=rng.choice(FOODS),
        )
        for title, number in zip(titles, numbers, strict=True)
    ]
    return sorted(pages, key=lambda page: page.id)


def trigrams(word: str) -> set[str]:
    padded = f"  {word} "
    return {padded[i : i + 3] for i in range(len(padded) - 2)}


def similarity(a: str, b: str) -> float:
    """Jaccard similarity of the letter trigrams of two words (1.0: the same word)."""
    ta, tb = trigrams(a), trigrams(b)
    return len(ta & tb) / len(ta | tb)


def words(text: str) -> list[str]:
    return re.findall(r"[a-z]+", text.lower())


class Corpus:
    """Pages by id, and the two tools' bodies (module docstring)."""

    def __init__(self, pages: list[Page], num_results: int = 2) -> None:
        if not pages:
            raise ValueError("wiki-search: the corpus has no pages")
        if num_results < 1:
            raise ValueError(f"wiki-search: num_results must be >= 1, got {num_results}")
        self.pages = {page.id: page for page in pages}
        self.by_title = {page.title.lower(): page for page in pages}
        self.num_results = num_results
        self.page_words = {page.id: set(words(page.text)) for page in pages}

    @classmethod
    def load(cls, path: str | Path = PAGES_PATH, num_results: int = 2) -> "Corpus":
        """The pages of a JSONL file (one `Page`'s fields a line), e.g. the shipped one."""
        lines = Path(path).read_text().splitlines()
        return cls([Page(**json.loads(line)) for line in lines if line.strip()], num_results)

    def score(self, page: Page, query_words: list[str]) -> float:
        title = page.title.lower()
        in_title = sum(word == title for word in query_words)
        in_text = sum(word in self.page_words[page.id] for word in query_words)
        closest = max(similarity(word, title) for word in query_words)
        return 3 * in_title + in_text + closest

    def search(self, query: str) -> str:
        """Search the pages; returns the ids and titles of the best matches, one per line."""
        query_words = words(query)
        if not query_words:
            return NO_RESULTS
        scored = [(self.score(page, query_words), page.id) for page in self.pages.values()]
        best = sorted(scored, key=lambda item: (-item[0], item[1]))[: self.num_results]
        lines = [f"{pid} {self.pages[pid].title}" for score, pid in best if score > 0]
        return "\n".join(lines) or NO_RESULTS

    def open(self, id: str) -> str:
        """Open a page by its id (from search); returns its text."""
        page = self.pages.get(str(id).strip())
        if page is None:
            raise ValueError(
                f"no page {id!r}; page ids come from search, e.g. {next(iter(self.pages))}"
            )
        return page.text


def write_pages(pages: list[Page], path: Path) -> None:
    path.write_text("".join(json.dumps(asdict(page)) + "\n" for page in pages))


if __name__ == "__main__":
    # Regenerates the shipped corpus: python -m wiki_search.corpus [OUT]
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else PAGES_PATH
    write_pages(generate_pages(0), out)
    print(out)
