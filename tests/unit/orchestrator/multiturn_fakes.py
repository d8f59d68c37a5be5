"""A scripted stand-in for an inference replica, for unit tests of multi-turn episodes only.

It renders chat messages with a small im_start/im_end template over byte tokens (like the tiny
test models), answers `/tokenize`-style requests with that template, and answers each chat
request with the next scripted completion. Its template can rewrite earlier assistant turns
(`rewrite_history`: only their first character is rendered), as some real templates do.
"""

import asyncio
from dataclasses import dataclass, field
from typing import Any

from rlbus.wire.tasks import ToolCall, ToolFunction
from rlbus_orchestrator.envs.base import ChatTurn

IM_START, IM_END = 1000, 1001


def text_ids(text: str) -> list[int]:
    return list(text.encode())


def render(
    messages: list[dict[str, Any]], *, generation_prompt: bool, rewrite_history: bool = False
) -> list[int]:
    last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=-1)
    ids: list[int] = []
    for i, message in enumerate(messages):
        content = message.get("content") or ""
        if rewrite_history and message["role"] == "assistant" and i < last_user:
            content = content[:1]
        ids += [IM_START, *text_ids(message["role"] + "\n" + content), IM_END, *text_ids("\n")]
    if generation_prompt:
        ids += [IM_START, *text_ids("assistant\n")]
    return ids


@dataclass
class Scripted:
    """One completion: its text, tool calls, and how it ended."""

    text: str
    tool_calls: list[tuple[str, str]] = field(default_factory=list)
    """(name, arguments JSON text) of each call."""
    finish_reason: str = "stop"
    hang: bool = False


@dataclass
class FakeEngine:
    script: list[Scripted]
    rewrite_history: bool = False
    version: int = 3
    requests: list[dict[str, Any]] = field(default_factory=list)

    async def chat(self, messages, sampling, turn=None, prefer=None) -> ChatTurn:
        self.requests.append(
            {"messages": messages, "sampling": sampling, "turn": turn, "prefer": prefer}
        )
        scripted = self.script.pop(0)
        if scripted.hang:
            await asyncio.sleep(3600)
        if turn is not None and turn.prompt_token_ids is not None:
            prompt = list(turn.prompt_token_ids)
        else:
            prompt = render(messages, generation_prompt=True, rewrite_history=self.rewrite_history)
        ids = text_ids(scripted.text)[: sampling.max_tokens]
        if scripted.finish_reason == "stop":
            ids.append(IM_END)
        calls = [
            ToolCall(id=f"call-{i}", function=ToolFunction(name=name, arguments=args))
            for i, (name, args) in enumerate(scripted.tool_calls)
        ]
        return ChatTurn(
            prompt_token_ids=prompt,
            completion_token_ids=ids,
            completion_logprobs=[-0.5] * len(ids),
            text="" if calls else scripted.text,
            finish_reason=scripted.finish_reason,
            policy_version=self.version,
            replica_id="r0",
            tool_calls=calls,
        )

    async def tokenize_chat(self, messages, tools=None, prefer=None) -> list[int]:
        return render(messages, generation_prompt=True, rewrite_history=self.rewrite_history)
