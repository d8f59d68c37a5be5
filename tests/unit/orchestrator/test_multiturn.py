"""Multi-turn episodes around a scripted engine (multiturn_fakes.py): the turn loop, tools and
their failures, limits, and the token-exact sequence (the real engine: tests/integration)."""

import asyncio
import json

import pytest
from multiturn_fakes import IM_END, FakeEngine, Scripted, render, text_ids

from rlbus.wire.tasks import (
    ChatMessage,
    EpisodeLimits,
    Problem,
    SamplingArgs,
    ToolCall,
    ToolFunction,
)
from rlbus_orchestrator.envs.base import Score
from rlbus_orchestrator.envs.multiturn import (
    EnvironmentAnswerError,
    EpisodeDeadline,
    MultiTurnEnv,
    Reply,
)
from rlbus_orchestrator.envs.tools import call_tool, tool
from rlbus_orchestrator.envs.turns import TemplateError, TurnTokens, bridge_tokens


@tool
def lookup(key: str, default: int = 0) -> str:
    """Look a key up.

    Longer text that is not part of the description."""
    return {"a": "1", "b": "2"}.get(key, str(default))


@tool(timeout_s=0.2)
async def stuck(seconds: float) -> str:
    """Never answers in time."""
    await asyncio.sleep(seconds)
    return "late"


@tool
def broken() -> str:
    raise ValueError("disk on fire")


class GuessEnv(MultiTurnEnv):
    """Guess the secret: the environment says higher/lower; tools may look keys up."""

    env_id = "guess"
    tools = [lookup, stuck, broken]
    max_turns = 4

    def num_examples(self, split):
        return 1

    def example(self, split, index):
        return Problem(messages=[ChatMessage(role="user", content="guess")], answer="7")

    def initial_state(self, problem):
        return {"guesses": 0}

    async def respond(self, problem, conversation, state):
        state["guesses"] += 1
        if conversation[-1]["content"] == problem.answer:
            return Reply(messages=[{"role": "user", "content": "yes"}], done=True)
        return Reply(messages=[{"role": "user", "content": "no"}])

    async def score(self, problem, conversation, state):
        solved = conversation[-1]["content"] == "yes"
        return Score(reward=float(solved), components={"guesses": float(state["guesses"])})


def play(engine, env=None, limits=None, sampling=None):
    env = env or GuessEnv()
    return asyncio.run(
        env.run_episode(engine, env.example("train", 0), sampling or SamplingArgs(), limits)
    )


def call(name, arguments):
    return ToolCall(id="c1", function=ToolFunction(name=name, arguments=arguments))


# ---- tools ----------------------------------------------------------------------------------


def test_a_tool_schema_comes_from_the_signature_and_the_docstrings_first_paragraph():
    assert lookup.schema() == {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Look a key up.",
            "parameters": {
                "type": "object",
                "properties": {"key": {"type": "string"}, "default": {"type": "integer"}},
                "required": ["key"],
            },
        },
    }


@pytest.mark.parametrize(
    ("name", "arguments", "expected"),
    [
        ("lookup", '{"key": "b"}', "2"),
        ("nope", "{}", "error: unknown tool 'nope'; the tools are: broken, lookup, stuck"),
        ("lookup", '{"key": ', "error: the arguments of 'lookup' are not a JSON object: Expecting"),
        ("lookup", '["a"]', "error: the arguments of 'lookup' are not a JSON object: ['a']"),
        (
            "lookup",
            '{"kee": "a"}',
            "error: bad arguments for 'lookup': missing a required argument",
        ),
        ("broken", "{}", "error: tool 'broken' raised ValueError: disk on fire"),
        ("stuck", '{"seconds": 30}', "error: tool 'stuck' timed out after 0.2 s"),
    ],
)
def test_every_failed_tool_call_is_a_tool_message_that_says_what_went_wrong(
    name, arguments, expected
):
    tools = {t.name: t for t in (lookup, stuck, broken)}
    outcome = asyncio.run(call_tool(tools, call(name, arguments)))
    assert outcome.message["role"] == "tool" and outcome.message["tool_call_id"] == "c1"
    assert outcome.message["content"].startswith(expected)
    assert outcome.failed is expected.startswith("error: ")


# ---- token-exact turns ----------------------------------------------------------------------


def test_the_bridge_is_the_end_of_the_turn_the_new_messages_and_the_generation_prompt():
    engine = FakeEngine([])
    new = [{"role": "tool", "content": "42"}]
    bridge = asyncio.run(bridge_tokens(engine, new))
    assert bridge == [IM_END, *text_ids("\n"), *render(new, generation_prompt=True)]


def test_a_template_that_drops_earlier_answers_is_refused_with_a_reason():
    class Dropping(FakeEngine):
        async def tokenize_chat(self, messages, tools=None, prefer=None):
            kept = [m for m in messages if m["role"] != "assistant"]
            return render(kept, generation_prompt=True)

    with pytest.raises(TemplateError, match="without its content"):
        asyncio.run(bridge_tokens(Dropping([]), [{"role": "user", "content": "x"}]))


def test_the_end_token_the_model_wrote_is_not_added_twice():
    engine = FakeEngine([Scripted("hi")])
    tokens = TurnTokens()
    tokens.add_model_turn(
        asyncio.run(engine.chat([{"role": "user", "content": "q"}], SamplingArgs()))
    )
    tokens.add_bridge([IM_END, 10, 11])
    assert tokens.ids == [*text_ids("hi"), IM_END, 10, 11]
    assert tokens.mask == [1, 1, 1, 0, 0]


@pytest.mark.parametrize("rewrite_history", [False, True])
def test_the_sample_is_exactly_what_the_engine_saw_and_wrote_turn_after_turn(rewrite_history):
    """Turn 2 is generated from turn 1's prompt and completion plus the bridge, also when the
    template renders earlier answers differently (rewrite_history): the sample is the prompt,
    both completions (trained) and the environment's tokens between them (not trained)."""
    engine = FakeEngine([Scripted("35"), Scripted("7")], rewrite_history=rewrite_history)
    sample = play(engine)
    prompt = render([{"role": "user", "content": "guess"}], generation_prompt=True)
    bridge = [*text_ids("\n"), *render([{"role": "user", "content": "no"}], generation_prompt=True)]
    turn_1, turn_2 = [*text_ids("35"), IM_END], [*text_ids("7"), IM_END]
    assert engine.requests[1]["turn"].prompt_token_ids == prompt + turn_1 + bridge
    assert sample.prompt_token_ids == prompt
    assert sample.completion_token_ids == turn_1 + bridge + turn_2
    assert sample.completion_mask == [1] * 3 + [0] * len(bridge) + [1] * 2
    assert sample.completion_logprobs == [-0.5] * 3 + [0.0] * len(bridge) + [-0.5] * 2
    assert (sample.reward, sample.reward_components) == (1.0, {"guesses": 2.0})
    assert (sample.num_turns, sample.stop_reason) == (2, "done")
    assert [m.content for m in sample.messages] == ["35", "no", "7", "yes"]


def test_an_engine_that_ignores_the_prompt_ids_fails_the_episode_instead_of_training_on_a_lie():
    class Rerendering(FakeEngine):
        async def chat(self, messages, sampling, turn=None, prefer=None):
            return await super().chat(messages, sampling, None, prefer)

    with pytest.raises(RuntimeError, match="prompt token reuse"):
        play(Rerendering([Scripted("35"), Scripted("7")], rewrite_history=True))


# ---- tools in an episode --------------------------------------------------------------------


def test_tool_calls_are_answered_by_the_tools_and_failures_are_counted_the_episode_goes_on():
    engine = FakeEngine(
        [
            Scripted("", tool_calls=[("lookup", '{"key": "a"}'), ("nope", "{}")]),
            Scripted("7"),
        ]
    )
    sample = play(engine)
    tool_messages = [m for m in sample.messages if m.role == "tool"]
    assert [m.content for m in tool_messages][0] == "1"
    assert tool_messages[1].content.startswith("error: unknown tool 'nope'")
    assert (sample.num_tool_calls, sample.num_tool_errors, sample.stop_reason) == (2, 1, "done")
    assert sample.messages[0].tool_calls[0].function.name == "lookup"
    assert engine.requests[0]["turn"].tools == [t.schema() for t in GuessEnv.tools]
    assert engine.requests[1]["prefer"] == "r0"  # the episode stays on its replica


def test_a_tool_call_the_engine_could_not_parse_is_answered_with_how_to_write_one():
    engine = FakeEngine([Scripted('<tool_call>{"name": "lookup", "arguments": {'), Scripted("7")])
    sample = play(engine)
    assert sample.messages[1].role == "tool"
    assert sample.messages[1].content.startswith("error: the tool call could not be parsed")
    assert (sample.num_tool_calls, sample.num_tool_errors) == (1, 1)


# ---- limits and bad environments ------------------------------------------------------------


def test_max_turns_ends_the_episode_and_it_is_still_scored():
    sample = play(
        FakeEngine([Scripted(str(i)) for i in range(5)]), limits=EpisodeLimits(max_turns=3)
    )
    assert (sample.num_turns, sample.stop_reason, sample.reward) == (3, "max_turns", 0.0)


def test_the_class_max_turns_applies_without_a_task_limit():
    sample = play(FakeEngine([Scripted(str(i)) for i in range(6)]))
    assert (sample.num_turns, sample.stop_reason) == (GuessEnv.max_turns, "max_turns")


def test_max_total_tokens_cuts_the_turns_budget_and_ends_the_episode():
    engine = FakeEngine([Scripted("1111111111"), Scripted("2222222222")])
    prompt_len = len(render([{"role": "user", "content": "guess"}], generation_prompt=True))
    sample = play(engine, limits=EpisodeLimits(max_total_tokens=prompt_len + 40))
    assert engine.requests[1]["sampling"].max_tokens < SamplingArgs().max_tokens
    assert sample.stop_reason == "max_total_tokens"
    assert len(sample.prompt_token_ids) + len(sample.completion_token_ids) <= prompt_len + 40 + 1


def test_a_turn_cut_at_max_tokens_ends_the_episode():
    sample = play(FakeEngine([Scripted("3", finish_reason="length")]))
    assert (sample.stop_reason, sample.is_truncated, sample.num_turns) == ("length", True, 1)


def test_the_deadline_ends_an_episode_after_its_first_turn_and_fails_one_before_it():
    sample = play(
        FakeEngine([Scripted("3"), Scripted("x", hang=True)]), limits=EpisodeLimits(deadline_s=0.3)
    )
    assert (sample.stop_reason, sample.num_turns) == ("deadline", 1)
    with pytest.raises(EpisodeDeadline, match="0.3 s"):
        play(FakeEngine([Scripted("x", hang=True)]), limits=EpisodeLimits(deadline_s=0.3))


@pytest.mark.parametrize("answer", ["no", {"role": "user"}, [{"role": "user", "content": 3}]])
def test_an_environment_answer_of_the_wrong_type_fails_the_episode_with_one_line(answer):
    class Bad(GuessEnv):
        async def respond(self, problem, conversation, state):
            return answer

    with pytest.raises(EnvironmentAnswerError, match="environment 'guess': respond\\(\\)"):
        play(FakeEngine([Scripted("3")]), env=Bad())


def test_a_reply_may_be_a_bare_list_of_messages():
    class Listing(GuessEnv):
        async def respond(self, problem, conversation, state):
            reply = await super().respond(problem, conversation, state)
            return reply if reply.done else reply.messages

    sample = play(FakeEngine([Scripted("3"), Scripted("7")]), env=Listing())
    assert (sample.stop_reason, sample.reward) == ("done", 1.0)
    assert json.loads(json.dumps([m.role for m in sample.messages])) == [
        "assistant", "user", "assistant", "user",
    ]  # fmt: skip


def test_play_episode_gives_the_tasks_limits_to_multi_turn_environments_only():
    from rlbus_orchestrator.envs.base import play_episode
    from rlbus_orchestrator.envs.reverse_text import ReverseTextEnv

    limits = EpisodeLimits(max_turns=1)
    env = GuessEnv()
    engine = FakeEngine([Scripted("3"), Scripted("7")])
    sample = asyncio.run(play_episode(env, engine, env.example("train", 0), SamplingArgs(), limits))
    assert (sample.num_turns, sample.stop_reason) == (1, "max_turns")
    single = ReverseTextEnv()
    engine = FakeEngine([Scripted("cba")])
    sample = asyncio.run(
        play_episode(single, engine, single.example("train", 0), SamplingArgs(), limits)
    )
    assert sample.num_turns == 1 and sample.stop_reason is None


def test_the_example_environment_of_the_docs_plays_and_scores():
    """docs/environments.md's example, as printed, against the scripted engine."""
    from pathlib import Path

    docs = (Path(__file__).resolve().parents[3] / "docs" / "environments.md").read_text()
    code = docs.split("## Multi-turn and tool environments", 1)[1].split("```python\n", 1)[1]
    namespace: dict = {}
    exec(code.split("```", 1)[0], namespace)
    env = namespace["GuessNumber"]()
    problem = env.example("train", 3)
    engine = FakeEngine(
        [
            Scripted("", tool_calls=[("lookup", '{"key": "pi"}')]),
            Scripted("99"),
            Scripted(problem.answer),
        ]
    )
    sample = asyncio.run(env.run_episode(engine, problem, SamplingArgs()))
    assert [m.content for m in sample.messages] == ["", "3", "99", "lower", problem.answer, "right"]
    assert (sample.stop_reason, sample.num_tool_calls, sample.reward) == ("done", 1, 0.5)
