"""wiki-search for rlbus: questions about a small made-up encyclopedia, answered with the tools
`search(query)` and `open(id)` (env.py, corpus.py), and its SFT demonstrations (demos.py).
Registered as `wiki-search` in the `rlbus.environments` entry point group;
`load_environment(**args)` builds it."""

from typing import Any

from wiki_search.env import WikiSearchEnv


def load_environment(**args: Any) -> WikiSearchEnv:
    """The `wiki-search` environment with `args` (`[[orchestrator.env]] args`)."""
    return WikiSearchEnv(**args)


__all__ = ["WikiSearchEnv", "load_environment"]
