"""Token-exact multi-turn episodes: the trained sequence is the tokens the engine saw and wrote.

A multi-turn episode is not sent as a growing conversation that the chat template renders again
each turn: a template may render earlier turns differently once later ones exist (Qwen3 drops
the thinking of earlier answers), and then what the model was trained on would not be what it
sampled from. Instead each later turn's prompt is built from token ids:

    prompt(k+1) = prompt(k) + completion(k) + bridge(new messages)

and the engine generates from exactly those ids (`envs.base.TurnRequest.prompt_token_ids`; it
echoes them back, which `TurnTokens.check_echo` verifies). The trained sample is prompt(1), then
every completion (loss mask 1) and every bridge (loss mask 0: environment and tool tokens are
never trained on).

The bridge is what the chat template writes after an assistant turn's content: the end of that
turn, the new messages (tool results, the environment's reply) and the next generation prompt.
`bridge_tokens` learns it from the engine's own template (`/tokenize`) on two stand-in
conversations that differ only in the assistant's content ("A" and "B"): the tokens after that
difference, which both renderings share, are the bridge. The real conversation is never
rendered, so a template that rewrites earlier turns cannot change what was already sampled. When
the completion already ends with the turn's end token (the model stopped on it), that token is
not added twice.
"""

import asyncio
from dataclasses import dataclass, field
from typing import Any, Protocol

from rlbus_orchestrator.envs.base import ChatTurn

STAND_IN_USER = {"role": "user", "content": "U"}
STAND_IN_ANSWERS = ("A", "B")


class TemplateError(ValueError):
    """The chat template does not render an assistant turn in a way a bridge can be cut from."""


class Tokenizes(Protocol):
    async def tokenize_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        prefer: str | None = None,
    ) -> list[int]: ...


def common_suffix_length(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[-1 - n] == b[-1 - n]:
        n += 1
    return n


async def bridge_tokens(
    client: Tokenizes,
    new_messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    prefer: str | None = None,
) -> list[int]:
    """The tokens the template writes after an assistant turn's content, for `new_messages`
    and the next generation prompt (see module docstring)."""
    a, b = await asyncio.gather(
        *(
            client.tokenize_chat(
                [STAND_IN_USER, {"role": "assistant", "content": answer}, *new_messages],
                tools,
                prefer,
            )
            for answer in STAND_IN_ANSWERS
        )
    )
    shared = common_suffix_length(a, b)
    if shared >= min(len(a), len(b)):
        raise TemplateError(
            "the chat template renders an earlier assistant turn without its content, so the "
            "tokens of the messages after it cannot be told apart; multi-turn episodes need a "
            "template that keeps the content of earlier assistant turns"
        )
    return a[len(a) - shared :]


@dataclass
class TurnTokens:
    """One episode's sequence as it grows: the first prompt, then completions and bridges."""

    prompt: list[int] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    last: ChatTurn | None = None

    def next_prompt(self) -> list[int]:
        """The prompt the next turn is generated from."""
        return self.prompt + self.ids

    def check_echo(self, turn: ChatTurn, sent: list[int] | None) -> None:
        """A later turn must have been generated from the ids sent (an engine that ignores
        them renders the messages again, and the sample would not be what it saw)."""
        if sent is not None and turn.prompt_token_ids != sent:
            raise RuntimeError(
                "inference generated a later turn from other prompt tokens than the ones sent: "
                "multi-turn episodes need vLLM's prompt token reuse "
                "(kv_transfer_params.prompt_token_ids, vLLM >= 0.32)"
            )

    def add_model_turn(self, turn: ChatTurn) -> None:
        if self.last is None:
            self.prompt = list(turn.prompt_token_ids)
        self.ids += turn.completion_token_ids
        self.logprobs += turn.completion_logprobs
        self.mask += [1] * len(turn.completion_token_ids)
        self.last = turn

    def add_bridge(self, bridge: list[int]) -> None:
        """Environment tokens after the last model turn (loss mask 0). The turn's end token is
        not doubled when the model already wrote it."""
        assert self.last is not None, "a bridge follows a model turn"
        completion = self.last.completion_token_ids
        stopped = self.last.finish_reason == "stop"
        if bridge and completion and stopped and completion[-1] == bridge[0]:
            bridge = bridge[1:]
        self.ids += bridge
        self.logprobs += [0.0] * len(bridge)
        self.mask += [0] * len(bridge)

    def total(self) -> int:
        return len(self.prompt) + len(self.ids)
