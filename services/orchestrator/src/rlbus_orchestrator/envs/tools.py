"""Tools an environment offers the model: OpenAI tool schemas out, tool messages back.

A `Tool` is a Python function (plain or async) with a JSON schema of its arguments. `tool()` makes
one from a function's signature and docstring:

    @tool(timeout_s=5)
    def search(query: str, limit: int = 3) -> str:
        '''Search the corpus; returns the best matching titles.'''

The schema (`Tool.schema`) is sent with every chat request of the episode; the engine parses the
model's tool calls (vLLM's tool-call parser of the model family, `inference.vllm.tool_call_parser`)
and `call_tool` runs each one. Whatever goes wrong becomes the tool message's text and the episode
goes on (the model may try again):

| what | the tool message |
| --- | --- |
| an unknown tool name | `error: unknown tool 'x'; the tools are: a, b` |
| arguments that are not JSON, or not a JSON object | `error: the arguments of 'x' are not a JSON object: ...` |
| arguments the function does not take | `error: bad arguments for 'x': missing a required argument: 'query'` |
| the function raises | `error: tool 'x' raised ValueError: ...` |
| it runs past `timeout_s` | `error: tool 'x' timed out after 5 s` |

An async tool past its deadline is cancelled. A plain function runs in a worker thread, which
Python cannot stop: the episode goes on without it, the thread ends when the function returns.
Write tools that can hang (network, subprocesses) as async functions.
"""

import asyncio
import inspect
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, get_type_hints, overload

from rlbus.wire.tasks import ToolCall

JSON_TYPES: dict[Any, str] = {
    str: "string",
    int: "integer",
    float: "number",
    bool: "boolean",
    list: "array",
    dict: "object",
}
ERROR_PREFIX = "error: "
"""Every failed call's tool message starts with it (and is counted in `num_tool_errors`)."""


@dataclass
class Tool:
    """A function the model may call (see module docstring)."""

    name: str
    description: str
    parameters: dict[str, Any]
    """JSON schema of the arguments (an object schema)."""
    fn: Callable[..., Any]
    timeout_s: float = 10.0

    def schema(self) -> dict[str, Any]:
        """The OpenAI tool schema sent with the chat request."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": self.parameters,
            },
        }


def parameters_of(fn: Callable[..., Any]) -> dict[str, Any]:
    """An object schema from `fn`'s signature: one property per parameter, typed from its
    annotation (str, int, float, bool, list, dict; anything else is left untyped), required
    unless it has a default."""
    hints = get_type_hints(fn)
    properties: dict[str, Any] = {}
    required = []
    for name, param in inspect.signature(fn).parameters.items():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        json_type = JSON_TYPES.get(hints.get(name))
        properties[name] = {"type": json_type} if json_type else {}
        if param.default is param.empty:
            required.append(name)
    return {"type": "object", "properties": properties, "required": required}


@overload
def tool(fn: Callable[..., Any], /) -> Tool: ...


@overload
def tool(
    *,
    name: str | None = None,
    description: str | None = None,
    parameters: dict[str, Any] | None = None,
    timeout_s: float = 10.0,
) -> Callable[[Callable[..., Any]], Tool]: ...


def tool(
    fn: Callable[..., Any] | None = None,
    /,
    *,
    name: str | None = None,
    description: str | None = None,
    parameters: dict[str, Any] | None = None,
    timeout_s: float = 10.0,
) -> Tool | Callable[[Callable[..., Any]], Tool]:
    """A `Tool` from a function: its name, the first paragraph of its docstring and a schema
    from its signature, unless given (`@tool` or `@tool(timeout_s=5)`)."""

    def make(function: Callable[..., Any]) -> Tool:
        doc = inspect.getdoc(function) or ""
        return Tool(
            name=name or function.__name__,
            description=description if description is not None else doc.split("\n\n")[0],
            parameters=parameters if parameters is not None else parameters_of(function),
            fn=function,
            timeout_s=timeout_s,
        )

    return make(fn) if fn is not None else make


@dataclass
class ToolOutcome:
    """The tool message answering one call, and whether the call failed."""

    message: dict[str, Any]
    failed: bool


def tool_message(call_id: str, name: str, content: str) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call_id, "name": name, "content": content}


def failed(call: ToolCall, why: str) -> ToolOutcome:
    return ToolOutcome(tool_message(call.id, call.function.name, ERROR_PREFIX + why), True)


async def call_tool(tools: dict[str, Tool], call: ToolCall) -> ToolOutcome:
    """Run one tool call; every failure is a tool message that says what went wrong."""
    name = call.function.name
    found = tools.get(name)
    if found is None:
        return failed(call, f"unknown tool {name!r}; the tools are: {', '.join(sorted(tools))}")
    try:
        arguments = json.loads(call.function.arguments or "{}")
    except ValueError as error:
        return failed(call, f"the arguments of {name!r} are not a JSON object: {error}")
    if not isinstance(arguments, dict):
        return failed(call, f"the arguments of {name!r} are not a JSON object: {arguments!r}")
    try:
        inspect.signature(found.fn).bind(**arguments)
    except TypeError as error:
        return failed(call, f"bad arguments for {name!r}: {error}")
    try:
        result = await asyncio.wait_for(run(found.fn, arguments), found.timeout_s)
    except TimeoutError:
        return failed(call, f"tool {name!r} timed out after {found.timeout_s:g} s")
    except Exception as error:
        return failed(call, f"tool {name!r} raised {type(error).__name__}: {error}")
    text = result if isinstance(result, str) else json.dumps(result, default=str)
    return ToolOutcome(tool_message(call.id, name, text), False)


async def run(fn: Callable[..., Any], arguments: dict[str, Any]) -> Any:
    """`fn(**arguments)`: awaited when async, in a worker thread when not."""
    if inspect.iscoroutinefunction(fn):
        return await fn(**arguments)
    return await asyncio.to_thread(fn, **arguments)
