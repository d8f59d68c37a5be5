"""Classic verifiers multi-turn and tool environments played turn by turn (envs/verifiers_adapter.py),
with objects of the classic verifiers shape (env_response / is_completed / oai_tools / rubric) and
the scripted engine of multiturn_fakes.py; shapes that cannot be played are refused at build."""

import asyncio
import json
from types import SimpleNamespace

import pytest
from multiturn_fakes import FakeEngine, Scripted

from rlbus.wire.tasks import SamplingArgs
from rlbus_orchestrator.envs.verifiers_adapter import (
    UnsupportedEnvironmentError,
    VerifiersAdapter,
    VerifiersMultiTurnAdapter,
    adapt,
)


def correct(completion, answer) -> float:
    answers = [m["content"] for m in completion if m["role"] == "assistant"]
    return float(answers[-1] == answer)


class DoubleCheck:
    """Asks "are you sure?" once, in the classic shape (async methods, (messages, state) replies)."""

    max_turns = 5
    dataset = [{"question": "2+2?", "answer": "4"}]
    system_prompt = "Answer with a number."
    rubric = SimpleNamespace(funcs=[correct], weights=[1.0])

    async def setup_state(self, state, **kwargs):
        state["asked"] = False
        return state

    async def is_completed(self, messages, state, **kwargs):
        return state["asked"] and messages[-1]["role"] == "assistant"

    async def env_response(self, messages, state, **kwargs):
        state = dict(state, asked=True)
        return [{"role": "user", "content": "Are you sure?"}], state


class Lookup:
    """A ToolEnv-like environment: it runs the model's tool calls itself (sync methods)."""

    dataset = [{"prompt": [{"role": "user", "content": "what is a?"}], "answer": "1"}]
    oai_tools = [{"type": "function", "function": {"name": "lookup", "parameters": {}}}]
    rubric = SimpleNamespace(funcs=[correct])

    def is_completed(self, messages, state, **kwargs):
        return messages[-1]["role"] == "assistant" and not messages[-1].get("tool_calls")

    def env_response(self, messages, state, **kwargs):
        return [
            {"role": "tool", "tool_call_id": call["id"], "content": json.loads(call["function"]["arguments"])["key"]}
            for call in messages[-1]["tool_calls"]
        ]  # fmt: skip


def play(env_object, script):
    env = adapt("classic", env_object)
    engine = FakeEngine(script)
    sample = asyncio.run(env.run_episode(engine, env.example("train", 0), SamplingArgs()))
    return env, engine, sample


def test_a_classic_multi_turn_environment_is_played_turn_by_turn_and_scored_by_its_rubric():
    env, engine, sample = play(DoubleCheck(), [Scripted("5"), Scripted("4")])
    assert isinstance(env, VerifiersMultiTurnAdapter) and env.max_turns == 5
    assert (sample.num_turns, sample.stop_reason, sample.reward) == (2, "done", 1.0)
    assert [m.content for m in sample.messages] == ["5", "Are you sure?", "4"]
    assert engine.requests[0]["messages"][0] == {
        "role": "system",
        "content": "Answer with a number.",
    }


def test_a_classic_tool_environment_gets_the_parsed_calls_and_answers_them_itself():
    _, engine, sample = play(
        Lookup(), [Scripted("", tool_calls=[("lookup", '{"key": "a"}')]), Scripted("1")]
    )
    assert engine.requests[0]["turn"].tools == Lookup.oai_tools
    assert [(m.role, m.content) for m in sample.messages[1:]] == [("tool", "a"), ("assistant", "1")]
    assert (sample.num_tool_calls, sample.stop_reason, sample.reward) == (1, "done", 1.0)


def test_a_single_turn_verifiers_environment_keeps_the_one_turn_adapter():
    single = SimpleNamespace(
        dataset=[{"question": "q", "answer": "a"}], rubric=SimpleNamespace(funcs=[correct])
    )
    assert type(adapt("one", single)) is VerifiersAdapter


@pytest.mark.parametrize(
    ("shape", "why"),
    [
        (SimpleNamespace(message_type="completion", rubric=None), "completion-format"),
        (
            SimpleNamespace(envs=[DoubleCheck()], rubric=None),
            "own \\[\\[orchestrator.env\\]\\] entry",
        ),
        (SimpleNamespace(rollout=lambda *a: None, rubric=None), "own rollout\\(\\)"),
    ],
)
def test_shapes_that_cannot_be_played_turn_by_turn_are_refused_with_one_line(shape, why):
    with pytest.raises(
        UnsupportedEnvironmentError, match=f"environment 'x' cannot be played: .*{why}"
    ):
        adapt("x", shape)


def test_a_module_environment_is_used_as_is_or_adapted_turn_by_turn(tmp_path, monkeypatch):
    """`load_environment` of a module may return an rlbus environment (used as it is) or a
    classic verifiers one (a multi-turn one is played turn by turn)."""
    import textwrap

    from rlbus_orchestrator.envs.registry import load_environment

    (tmp_path / "native_mt_env.py").write_text(
        textwrap.dedent("""
        from rlbus_orchestrator.envs import MultiTurnEnv
        class Native(MultiTurnEnv):
            env_id = "native-mt-env"
            def num_examples(self, split): return 1
            def example(self, split, index): return None
            async def score(self, problem, conversation, state): return None
        def load_environment(**kwargs):
            return Native()
        """)
    )
    (tmp_path / "classic_mt_env.py").write_text(
        textwrap.dedent("""
        class Rubric:
            funcs = [lambda completion, answer: 1.0]
        class Env:
            dataset = [{"question": "hi", "answer": "hi"}]
            rubric = Rubric()
            def is_completed(self, messages, state): return True
            def env_response(self, messages, state): return []
        def load_environment(**kwargs):
            return Env()
        """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert type(load_environment("native-mt-env")).__name__ == "Native"
    assert isinstance(load_environment("classic-mt-env"), VerifiersMultiTurnAdapter)
