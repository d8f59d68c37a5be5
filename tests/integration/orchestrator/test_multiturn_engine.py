"""Multi-turn episodes against a real replica (vLLM on CPU, the tiny test model): every later
turn is generated from exactly the ids the episode sent, also under a chat template that rewrites
earlier answers; tool calls parsed by vLLM's tool-call parser are run and answered; environment
and tool tokens are masked out of the loss."""

import asyncio
import shutil
from pathlib import Path

import httpx
import pytest
from replica_support import VLLM_TEST_ARGS, start_standalone

from rlbus.wire.replicas import ReplicaInfo
from rlbus.wire.tasks import ChatMessage, EpisodeLimits, Problem, SamplingArgs
from rlbus_orchestrator.client import InferenceClient, ReplicaPool
from rlbus_orchestrator.envs.base import Score
from rlbus_orchestrator.envs.multiturn import MultiTurnEnv, Reply
from rlbus_orchestrator.envs.tools import tool
from rlbus_orchestrator.envs.turns import bridge_tokens

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[3]
# Earlier answers (before the last user message) are rendered with their first character only:
# a conversation rendered again is not what the model saw when it wrote its later turns.
REWRITING_TEMPLATE = (
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for m in messages %}{%- if m['role'] == 'user' %}{%- set ns.last_user = loop.index0 %}"
    "{%- endif %}{%- endfor %}"
    "{%- for m in messages %}{%- set content = m['content'] or '' %}"
    "{%- if m['role'] == 'assistant' and loop.index0 < ns.last_user %}"
    "{%- set content = content[:1] %}{%- endif %}"
    "{{- '<|im_start|>' + m['role'] + '\\n' + content + '<|im_end|>' + '\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


PROMPT = [
    ChatMessage(role="system", content="Reverse the text character by character."),
    ChatMessage(role="user", content="abcdef"),
]


class NeverRight(MultiTurnEnv):
    """Every answer gets "again": the episode runs to max_turns."""

    env_id = "never-right"

    def num_examples(self, split):
        return 1

    def example(self, split, index):
        return Problem(messages=PROMPT)

    async def respond(self, problem, conversation, state):
        return Reply(messages=[{"role": "user", "content": "again"}])

    async def score(self, problem, conversation, state):
        return Score(reward=0.0, components={})


@tool
def lookup(q: str) -> str:
    """Look q up."""
    return f"found {q}"


class AlwaysTools(NeverRight):
    env_id = "always-tools"
    tools = [lookup]


@pytest.fixture(scope="module")
def replica(tmp_path_factory):
    model = tmp_path_factory.mktemp("model") / "rewriting"
    shutil.copytree(REPO / "examples" / "reverse-text" / "model", model)
    (model / "chat_template.jinja").write_text(REWRITING_TEMPLATE)
    started = start_standalone(model, model.parent / "replica.log", vllm_args=VLLM_TEST_ARGS)
    try:
        yield started, str(model)
    finally:
        started.stop()


def play(replica, env, sampling, limits):
    server, model = replica

    async def episode():
        pool = ReplicaPool()
        pool.update([ReplicaInfo(replica_id="r0", base_url=server.public_url + "/v1", model=model)])
        async with httpx.AsyncClient(timeout=120) as http:
            client = InferenceClient(pool, http, model)
            sample = await env.run_episode(client, env.example("train", 0), sampling, limits)
            messages = [{"role": m.role, "content": m.content} for m in PROMPT] + [
                {"role": m.role, "content": m.content} for m in sample.messages
            ]
            rendered = await client.tokenize_chat(messages[:-1])
            bridges = [
                await bridge_tokens(client, group, [t.schema() for t in env.tools] or None)
                for group in environment_answers(messages[len(PROMPT) :])
            ]
            return sample, rendered, bridges

    return asyncio.run(episode())


def environment_answers(conversation):
    """The messages after each assistant turn, grouped (a turn's tool results, a reply)."""
    groups = []
    for message in conversation:
        if message["role"] == "assistant":
            groups.append([])
        elif groups:
            groups[-1].append(message)
    return [group for group in groups if group]


def runs(mask, value):
    """(start, end) of each run of `value` in `mask`."""
    out, start = [], None
    for i, m in enumerate([*mask, None]):
        if m == value and start is None:
            start = i
        elif m != value and start is not None:
            out.append((start, i))
            start = None
    return out


def test_a_template_that_rewrites_history_still_trains_on_exactly_what_the_engine_saw(replica):
    """Each later turn's prompt, echoed by vLLM, is the episode's own ids (the episode checks
    the echo and fails otherwise); the sample is prompt + turns + bridges, the bridges masked;
    rendering the conversation again gives other tokens (the template shortens old answers)."""
    sample, rendered, bridges = play(
        replica,
        NeverRight(),
        SamplingArgs(temperature=1.0, max_tokens=16, seed=1),
        EpisodeLimits(max_turns=3),
    )
    assert (sample.num_turns, sample.stop_reason) == (3, "max_turns")
    sequence = sample.prompt_token_ids + sample.completion_token_ids
    environment_runs = runs(sample.completion_mask, 0)
    assert len(runs(sample.completion_mask, 1)) == 3 and len(environment_runs) == 2
    assert len(bridges) >= len(environment_runs)  # the last answer ends the episode untrained
    for (start, end), bridge in zip(environment_runs, bridges, strict=False):
        # the end-of-turn token the model wrote is kept once, in its own (trained) turn
        assert bridge[-(end - start) :] == sample.completion_token_ids[start:end]
    assert all(
        lp == 0.0
        for lp, m in zip(sample.completion_logprobs, sample.completion_mask, strict=True)
        if m == 0
    )
    assert any(len(m.content) > 1 for m in sample.messages[:-1] if m.role == "assistant")
    assert rendered != sequence[: len(rendered)]


def test_tool_calls_parsed_by_vllm_are_run_answered_and_masked(replica):
    """`tool_choice = "required"` makes the tiny model write a hermes tool call; vLLM's parser
    returns it parsed, the environment runs it (or answers what was wrong with it), and the tool
    message's tokens are in the sample with loss mask 0."""
    sampling = SamplingArgs(
        temperature=1.0, max_tokens=80, seed=2, extra={"tool_choice": "required"}
    )
    sample, _, bridges = play(replica, AlwaysTools(), sampling, EpisodeLimits(max_turns=2))
    assert sample.num_tool_calls >= 1, sample.messages
    tool_messages = [m for m in sample.messages if m.role == "tool"]
    assert tool_messages and all(m.tool_call_id for m in tool_messages)
    assert (
        sample.messages[0].tool_calls and sample.messages[0].tool_calls[0].function.name == "lookup"
    )
    start, end = runs(sample.completion_mask, 0)[0]
    assert bridges[0][-(end - start) :] == sample.completion_token_ids[start:end]
