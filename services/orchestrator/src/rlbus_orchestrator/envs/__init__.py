"""Environments: the interface, the built-ins and the lookup by id (see `base` and `registry`)."""

from rlbus_orchestrator.envs.base import (
    ChatClient,
    ChatTurn,
    Environment,
    GroupEnvironment,
    Score,
    SingleTurnEnv,
    Split,
    merge_turns,
    sample_from_turns,
)
from rlbus_orchestrator.envs.multiturn import MultiTurnEnv, Reply
from rlbus_orchestrator.envs.registry import EnvironmentNotFoundError, load_environment
from rlbus_orchestrator.envs.reverse_text import ReverseTextEnv, reverse_reward
from rlbus_orchestrator.envs.tools import Tool, tool

__all__ = [
    "ChatClient",
    "ChatTurn",
    "Environment",
    "EnvironmentNotFoundError",
    "GroupEnvironment",
    "MultiTurnEnv",
    "Reply",
    "ReverseTextEnv",
    "Score",
    "SingleTurnEnv",
    "Split",
    "Tool",
    "load_environment",
    "merge_turns",
    "reverse_reward",
    "sample_from_turns",
    "tool",
]
