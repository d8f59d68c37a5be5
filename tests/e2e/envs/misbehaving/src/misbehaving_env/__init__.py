"""A multi-turn environment whose episodes go wrong on purpose, one way per problem:

0. `respond` raises                         -> the episode fails (dropped: error), the group trains
1. `respond` answers with a str              -> the episode fails (wrong answer type)
2. `respond` never says done                 -> the episode ends at max_turns
3. the model's tool call hangs past timeout  -> an error tool message, the episode goes on
4. the model calls a tool nobody implements  -> an error tool message, the episode goes on

Ways 3 and 4 are played by the `misbehaving-tools` id, configured with `tool_choice =
"required"` in its own sampling so the tiny reverse-text model writes a tool call every turn;
`misbehaving` plays ways 0-2 without tools. The reward is the reverse-text ratio of the first
answer (a tool call scores 0), so the run trains as usual.
"""

import asyncio
import difflib
import random
import string

from rlbus.wire.tasks import ChatMessage, Problem
from rlbus_orchestrator.envs import MultiTurnEnv, Reply, tool
from rlbus_orchestrator.envs.base import Score

WAYS = ("raises", "wrong_type", "never_done", "tool_hangs", "unknown_tool")
"""index % 5 in the module docstring; each id plays its own part of them."""


@tool(timeout_s=0.5)
async def slow(q: str) -> str:
    """Answers after a minute."""
    await asyncio.sleep(60)
    return q


class MisbehavingEnv(MultiTurnEnv):
    env_id = "misbehaving"
    tools = [slow]
    max_turns = 3

    def __init__(self, ways: tuple[str, ...] = WAYS[:3], env_id: str = "misbehaving") -> None:
        self.ways, self.env_id = tuple(ways), env_id

    def tool_schemas(self):
        ghost = {"type": "function", "function": {"name": "ghost", "parameters": {}}}
        return [*super().tool_schemas(), ghost]

    def num_examples(self, split):
        return None

    def example(self, split, index):
        rng = random.Random(f"misbehaving/{split}/{index}")
        text = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(5, 10)))
        way = self.ways[index % len(self.ways)]
        messages = [
            ChatMessage(role="system", content="Reverse the text character by character."),
            ChatMessage(role="user", content=text),
        ]
        return Problem(messages=messages, answer=text[::-1], info={"way": way})

    async def respond(self, problem, conversation, state):
        way = problem.info["way"]
        if way == "raises":
            raise RuntimeError("the environment broke on purpose")
        if way == "wrong_type":
            return "a str is not a Reply"
        if way == "never_done":
            return Reply(messages=[{"role": "user", "content": "again"}])
        return Reply(done=True)

    async def score(self, problem, conversation, state):
        answer = conversation[0]["content"].strip()
        ratio = difflib.SequenceMatcher(None, answer, problem.answer).ratio()
        return Score(reward=ratio, components={"lcs_ratio": ratio})


def with_tools() -> MisbehavingEnv:
    """The `misbehaving-tools` id: ways 3 and 4."""
    return MisbehavingEnv(ways=WAYS[3:], env_id="misbehaving-tools")
