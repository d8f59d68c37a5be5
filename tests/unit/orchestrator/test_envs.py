import asyncio
import re
import subprocess
import sys
import textwrap
from importlib.metadata import EntryPoint

import msgspec
import pytest

from rlbus.wire.tasks import SamplingArgs
from rlbus_orchestrator.envs import (
    ChatTurn,
    EnvironmentNotFoundError,
    GroupEnvironment,
    ReverseTextEnv,
    load_environment,
    merge_turns,
    registry,
    reverse_reward,
)


def make_turn(prompt, completion, text="", version=3, finish="stop"):
    return ChatTurn(
        prompt_token_ids=prompt,
        completion_token_ids=completion,
        completion_logprobs=[-0.5] * len(completion),
        text=text,
        finish_reason=finish,
        policy_version=version,
    )


class FakeClient:
    def __init__(self, text):
        self.text = text
        self.seen = []

    async def chat(self, messages, sampling):
        self.seen.append(messages)
        return make_turn([1, 2, 3], [7, 8], text=self.text)


def test_reverse_reward_is_one_for_exact_reverse_and_lower_otherwise():
    assert reverse_reward("cba", "abc") == 1.0
    assert 0 < reverse_reward("cbx", "abc") < 1
    assert reverse_reward("", "abc") == 0.0


def test_reverse_text_data_is_deterministic_per_seed_and_split():
    a, b = ReverseTextEnv(seed=1), ReverseTextEnv(seed=1)
    assert [a.text("train", i) for i in range(20)] == [b.text("train", i) for i in range(20)]
    assert [a.text("train", i) for i in range(20)] != [
        ReverseTextEnv(seed=2).text("train", i) for i in range(20)
    ]
    assert [a.text("train", i) for i in range(20)] != [a.text("eval", i) for i in range(20)]


def test_reverse_text_lengths_follow_config():
    env = ReverseTextEnv(min_len=3, max_len=4)
    lengths = {len(env.text("train", i)) for i in range(100)}
    assert lengths == {3, 4}


def test_reverse_text_cursor_resumes_at_any_index():
    env = ReverseTextEnv(seed=5)
    problem = env.example("train", 1234)
    assert problem.answer == env.text("train", 1234)[::-1]
    assert [m.role for m in problem.messages] == ["system", "user"]
    assert problem.messages[1].content == env.text("train", 1234)


def test_reverse_text_episode_scores_the_stripped_answer():
    env = ReverseTextEnv()
    problem = env.example("train", 0)
    sample = asyncio.run(
        env.run_episode(FakeClient(problem.answer + "\n"), problem, SamplingArgs(temperature=0.7))
    )
    assert sample.reward == 1.0
    assert sample.reward_components == {"lcs_ratio": 1.0}
    assert sample.prompt_token_ids == [1, 2, 3]
    assert sample.completion_mask == [1, 1]
    assert sample.temperature == 0.7
    assert sample.policy_version == 3


class ScriptedClient:
    """Answers with the scripted texts in order, by `chat` or `chat_n` alike."""

    def __init__(self, texts):
        self.texts = list(texts)
        self.calls = []

    def turn(self):
        text = self.texts.pop(0)
        return make_turn([1, 2, 3], [ord(c) for c in text], text=text)

    async def chat(self, messages, sampling):
        self.calls.append(("chat", 1))
        return self.turn()

    async def chat_n(self, messages, sampling, n):
        self.calls.append(("chat_n", n))
        return [self.turn() for _ in range(n)]


def sample_fields(sample):
    """Every field of a sample but its wall-clock timings."""
    fields = msgspec.structs.asdict(sample)
    del fields["timings"]
    return fields


def test_reverse_text_group_path_gives_the_samples_of_the_per_episode_path():
    env = ReverseTextEnv()
    problem = env.example("train", 0)
    texts = [problem.answer, problem.answer[:3] + " ", "x"]
    sampling = SamplingArgs(temperature=0.9)
    grouped_client = ScriptedClient(texts)
    grouped = asyncio.run(env.run_group(grouped_client, problem, sampling, 3))
    episodes_client = ScriptedClient(texts)
    episodes = [asyncio.run(env.run_episode(episodes_client, problem, sampling)) for _ in range(3)]
    assert grouped_client.calls == [("chat_n", 3)] and episodes_client.calls == [("chat", 1)] * 3
    assert [sample_fields(s) for s in grouped] == [sample_fields(s) for s in episodes]
    assert [s.reward for s in grouped][0] == 1.0 and grouped[1].completion_text == problem.answer[
        :3
    ]
    assert all("score" in s.timings for s in grouped)


def test_reverse_text_rejects_bad_lengths():
    with pytest.raises(ValueError, match="min_len"):
        ReverseTextEnv(min_len=5, max_len=2)


def test_merge_turns_masks_environment_tokens_between_model_turns():
    first = make_turn([1, 2], [3, 4])
    second = make_turn([1, 2, 3, 4, 9, 9], [5])
    prompt, ids, logprobs, mask = merge_turns([first, second])
    assert prompt == [1, 2]
    assert ids == [3, 4, 9, 9, 5]
    assert mask == [1, 1, 0, 0, 1]
    assert logprobs == [-0.5, -0.5, 0.0, 0.0, -0.5]


def test_merge_turns_rejects_a_prompt_that_rewrites_history():
    with pytest.raises(ValueError, match="extend"):
        merge_turns([make_turn([1, 2], [3]), make_turn([1, 5, 3], [4])])


def test_entry_point_environment_is_found_by_id(monkeypatch):
    ep = EntryPoint(
        name="my-env",
        value="rlbus_orchestrator.envs.reverse_text:ReverseTextEnv",
        group=registry.ENTRY_POINT_GROUP,
    )
    monkeypatch.setattr(
        registry, "entry_points", lambda group: [ep] if group == registry.ENTRY_POINT_GROUP else []
    )
    env = load_environment("my-env", {"min_len": 3, "max_len": 3})
    assert isinstance(env, ReverseTextEnv) and len(env.text("train", 0)) == 3


def test_unknown_environment_fails_with_install_command():
    with pytest.raises(EnvironmentNotFoundError, match=r"rl env install <name or path>"):
        load_environment("no-such-env")


def test_builtin_environment_receives_args():
    env = load_environment("reverse-text", {"min_len": 2, "max_len": 2})
    assert len(env.text("train", 0)) == 2


def test_verifiers_style_module_is_adapted(tmp_path, monkeypatch):
    (tmp_path / "tiny_echo_env.py").write_text(
        textwrap.dedent("""
        class Rubric:
            def __init__(self):
                async def exact(completion, answer):
                    return float(completion[-1]["content"].strip() == answer)
                def length(text, **kwargs):
                    return len(text) / 10
                self.funcs = [exact, length]
                self.weights = [1.0, 0.5]

        class Env:
            system_prompt = "Echo the word."
            dataset = [{"question": "hi", "answer": "hi"}, {"question": "yo", "answer": "yo"}]
            rubric = Rubric()

        def load_environment(**kwargs):
            return Env()
    """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    env = load_environment("tiny-echo-env")
    assert env.num_examples("train") == 2
    problem = env.example("train", 1)
    assert [m.content for m in problem.messages] == ["Echo the word.", "yo"]
    sample = asyncio.run(env.run_episode(FakeClient("yo"), problem, SamplingArgs()))
    assert sample.reward_components == {"exact": 1.0, "length": 0.2}
    assert sample.reward == pytest.approx(1.1)
    assert not isinstance(env, GroupEnvironment)  # the per-episode path, as before
    assert isinstance(ReverseTextEnv(), GroupEnvironment)


def test_importing_the_orchestrator_does_not_import_torch_or_vllm():
    code = (
        "import sys, rlbus_orchestrator.envs, rlbus_orchestrator.packing, rlbus_orchestrator.advantages;"
        "import rlbus_orchestrator.service;"
        "bad = [m for m in ('torch', 'vllm', 'transformers') if m in sys.modules]; assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_service_with_unknown_environment_exits_before_connecting():
    from rlbus.configs.orchestrator import OrchestratorConfig
    from rlbus_orchestrator.service import run

    # model_copy skips the config's own id check, which the service must not rely on.
    config = OrchestratorConfig(run={"name": "x"}, bus={"url": "nats://127.0.0.1:1"})
    config.env[0] = config.env[0].model_copy(update={"id": "no-such-env"})
    with pytest.raises(SystemExit, match="rl env install"):
        run(config)


def test_config_accepts_an_id_whose_module_is_importable(tmp_path, monkeypatch):
    from rlbus.configs.orchestrator import OrchestratorConfig

    (tmp_path / "tiny_module_env.py").write_text("def load_environment(**kwargs): ...\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    config = OrchestratorConfig(env=[{"id": "tiny-module-env"}, {"id": "reverse-text"}])
    assert [e.id for e in config.env] == ["tiny-module-env", "reverse-text"]


def test_config_names_the_unknown_id_the_known_ids_and_a_guess():
    from pydantic import ValidationError

    from rlbus.configs.orchestrator import OrchestratorConfig

    with pytest.raises(ValidationError) as error:
        OrchestratorConfig(env=[{"id": "reverse-txt"}])
    ((loc, message),) = [(e["loc"], e["msg"]) for e in error.value.errors()]
    assert loc == ("env", 0, "id")
    assert "unknown environment 'reverse-txt'" in message
    assert "did you mean 'reverse-text'?" in message
    # every installed environment package is known too (the tests install some into the venv)
    assert re.search(r"known ids: [^;]*\breverse-text\b", message), message
