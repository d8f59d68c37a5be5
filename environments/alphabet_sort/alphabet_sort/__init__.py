"""alphabet-sort for rlbus: a multi-turn sorting environment (env.py) and its SFT
demonstrations (demos.py). Registered as `alphabet-sort` in the `rlbus.environments` entry point
group; `load_environment(**args)` builds it."""

from typing import Any

from alphabet_sort.env import AlphabetSortEnv


def load_environment(**args: Any) -> AlphabetSortEnv:
    """The `alphabet-sort` environment with `args` (`[[orchestrator.env]] args`)."""
    return AlphabetSortEnv(**args)


__all__ = ["AlphabetSortEnv", "load_environment"]
