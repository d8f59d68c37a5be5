"""The base class of every rlbus config.

`pydantic_config.BaseConfig` is a pydantic model with `extra="forbid"` plus the before-validators
the CLI loader relies on ("None" strings, dict value coercion, default union tags).
"""

from pydantic_config import BaseConfig

__all__ = ["BaseConfig"]
