"""The rules: the word list, per-letter feedback, and what a guess tells about the secret.

Feedback marks each letter of a guess with `G` (right letter, right place), `Y` (in the word,
elsewhere) or `-` (not in the word, or not that many times). Repeated letters follow Wordle's
rule: greens are marked first, then each other letter is `Y` only while the secret still has an
unmarked copy of it. `eel` against `elf` is `G-Y` (the one `e` of `elf` is taken by the green),
`eve` against `bee` is `Y-G`, `all` against `lab` is `YY-` (one `l` in `lab`, so one mark).

The model reads feedback as letter-mark pairs, `c- aG tY` for `cat` against `tan`: each mark
right after its letter, which is easier for a tiny character-level model to read than the marks
on a line of their own. After them comes the board: the letters placed so far by any guess,
`.a.` (`known_letters`). It repeats what earlier feedback said, like the letters a Wordle board
keeps on screen; it is there for the tiny model, which copies a placed letter from a fixed
distance (the board always ends the message right before the guess) far more easily than it
finds the green marks of earlier turns.
"""

from collections import Counter
from functools import cache
from importlib import resources

GREEN, YELLOW, ABSENT = "G", "Y", "-"


@cache
def word_list() -> tuple[str, ...]:
    """The shipped words (words.txt: lowercase, one per line, all the same length), sorted."""
    text = resources.files(__package__).joinpath("words.txt").read_text()
    words = tuple(sorted({line.strip() for line in text.splitlines() if line.strip()}))
    assert len({len(w) for w in words}) == 1, "words.txt holds words of one length"
    return words


def feedback(guess: str, secret: str) -> str:
    """The marks of `guess` against `secret`, one per letter (module docstring)."""
    assert len(guess) == len(secret), (guess, secret)
    marks = [ABSENT] * len(guess)
    unmatched: Counter[str] = Counter()
    for i, (g, s) in enumerate(zip(guess, secret, strict=True)):
        if g == s:
            marks[i] = GREEN
        else:
            unmatched[s] += 1
    for i, g in enumerate(guess):
        if marks[i] != GREEN and unmatched[g] > 0:
            marks[i] = YELLOW
            unmatched[g] -= 1
    return "".join(marks)


def render_feedback(guess: str, marks: str) -> str:
    """Feedback as the model reads it: `c- aG tY`."""
    return " ".join(letter + mark for letter, mark in zip(guess, marks, strict=True))


def known_letters(history: list[tuple[str, str]], length: int) -> str:
    """The board: each place's letter once a guess of `history` got it green, else `.`."""
    board = ["."] * length
    for guess, marks in history:
        for i, mark in enumerate(marks):
            if mark == GREEN:
                board[i] = guess[i]
    return "".join(board)


def consistent(word: str, history: list[tuple[str, str]]) -> bool:
    """Whether `word` could be the secret after the (guess, marks) of `history`."""
    return all(feedback(guess, word) == marks for guess, marks in history)


def candidates(words: tuple[str, ...], history: list[tuple[str, str]]) -> list[str]:
    """The words that could still be the secret."""
    return [w for w in words if consistent(w, history)]
