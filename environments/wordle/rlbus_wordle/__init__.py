"""`wordle` for rlbus: a word-guessing game sized for a tiny character-level model (env.py).

Registered as the environment id `wordle` (entry point group `rlbus.environments`); verifiers'
convention `load_environment(**args)` builds the same environment.
"""

from typing import Any

from rlbus_wordle.env import WordleEnv

__all__ = ["WordleEnv", "load_environment"]


def load_environment(**args: Any) -> WordleEnv:
    """The `wordle` environment with keyword arguments `args` (WordleEnv's)."""
    return WordleEnv(**args)
