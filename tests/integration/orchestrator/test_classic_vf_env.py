"""A classic verifiers environment from a venv of its own: `rl env install` of
environments/count_up_classic (it requires verifiers 0.1.3, from PyPI, into its own venv), then
the registry's `count-up` is played turn by turn through `classic_remote`: the environment's own
`env_response`, `is_completed` and rubric run in that venv's process (real verifiers 0.1.3), the
turns on the scripted engine of the multi-turn unit tests (the engine is not what is checked
here; the real engine plays it in tests/e2e/test_env_bad_inputs.py's neighbour,
test_classic_vf_run)."""

import asyncio
import itertools

import pytest
from env_packages import REPO
from unit.orchestrator.multiturn_fakes import FakeEngine, Scripted
from vf_support import rl_env_install, vf_env_dir

from rlbus import envindex
from rlbus.wire.tasks import SamplingArgs
from rlbus_orchestrator.envs.classic_remote import ClassicServerError
from rlbus_orchestrator.envs.registry import load_environment

pytestmark = pytest.mark.slow

PACKAGE = REPO / "environments" / "count_up_classic"


@pytest.fixture(scope="module")
def env_dir():
    """The shared test env directory with count-up installed (once; PyPI the first time)."""
    directory = vf_env_dir()
    result = rl_env_install(directory, PACKAGE)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "classic verifiers" in result.stdout
    return directory


@pytest.fixture
def env(env_dir, monkeypatch):
    monkeypatch.setenv(envindex.ENV_DIR_VAR, str(env_dir))
    environment = load_environment("count-up", {"num_turns": 3})
    yield environment
    environment.single.env.close()


def play(env, answers):
    problem = env.example("train", 1)
    engine = FakeEngine([Scripted(a) for a in answers])
    return problem, asyncio.run(env.run_episode(engine, problem, SamplingArgs()))


def test_the_classic_environment_answers_each_turn_and_scores_in_its_venv(env):
    assert env.num_examples("train") == 32
    problem, sample = play(env, ["8", "9", "11"])  # example 1 starts at 7: 8 9 10 is right
    assert problem.messages[-1].content == "7"
    assert (sample.num_turns, sample.stop_reason) == (3, "done")
    assert sample.reward == pytest.approx(2 / 3)
    assert sample.reward_components == {"right_share": pytest.approx(2 / 3)}
    # the environment's "next" between the answers is in the sequence, not trained on
    runs = [value for value, _ in itertools.groupby(sample.completion_mask)]
    assert runs == [1, 0, 1, 0, 1]


def test_a_dead_process_fails_the_episode_in_flight_and_the_next_one_starts_it_again(env):
    remote = env.single.env
    problem = env.example("train", 1)

    class KillsAfterTheFirstTurn(FakeEngine):
        async def chat(self, *args, **kwargs):
            turn = await super().chat(*args, **kwargs)
            remote.process.popen.kill()
            remote.process.popen.wait()
            return turn

    engine = KillsAfterTheFirstTurn([Scripted("8"), Scripted("9"), Scripted("10")])
    with pytest.raises(ClassicServerError, match="environment 'count-up': .*the earlier one died"):
        asyncio.run(env.run_episode(engine, problem, SamplingArgs()))
    assert play(env, ["8", "0", "10"])[1].reward == pytest.approx(2 / 3)
