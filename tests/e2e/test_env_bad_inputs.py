"""Episodes that go wrong do not stop a run: one `rl` run over an environment that misbehaves on
purpose (tests/e2e/envs/misbehaving: raises, answers with the wrong type, never says done, calls a
tool that hangs, calls a tool nobody implements). Each is counted in metrics.jsonl under its
environment and the run trains every step."""

from pathlib import Path

import pytest
from e2e_support import RlLaunch, run_rows
from env_packages import install_env_package

pytestmark = pytest.mark.slow

MAX_STEPS = 3
CONFIG = """
max_steps = {max_steps}
seq_len = 512

[model]
name = "{model}"

[orchestrator]
batch_size = 32
group_size = 4

[orchestrator.sampling]
max_tokens = 14

[[orchestrator.env]]
id = "misbehaving"

[[orchestrator.env]]
id = "misbehaving-tools"
max_turns = 2
sampling = {{ max_tokens = 80, extra_body = {{ tool_choice = "required" }} }}

[trainer.optim]
type = "adamw"
lr = 1e-4

[inference.vllm]
cpu_kv_cache_bytes = "256MiB"
enforce_eager = true
"""


def test_broken_episodes_and_tools_are_counted_per_environment_and_the_run_goes_on(
    tmp_path, starting_model
):
    install_env_package(Path(__file__).parent / "envs" / "misbehaving")
    config = tmp_path / "rl.toml"
    config.write_text(CONFIG.format(max_steps=MAX_STEPS, model=starting_model.path))
    run = RlLaunch(tmp_path / "out", "bad-inputs", config=config)
    try:
        assert run.wait() == 0, run.output()[-4000:]
    finally:
        run.kill()
    rows = run_rows(run.run_dir)
    assert [step for step, row in rows.items() if "loss" in row] == list(range(1, MAX_STEPS + 1))

    def total(key: str) -> float:
        return sum(row.get(key, 0.0) for row in rows.values())

    # raises / wrong type: episodes left out (their groups dropped: every episode of them failed)
    assert total("env/misbehaving/episodes_dropped/error") > 0
    assert total("env/misbehaving/dropped/error") > 0
    # never done: ended by the limit and trained
    assert total("env/misbehaving/stop/max_turns") > 0
    # a hanging tool and an unknown one: error tool messages, the episodes go on and train
    assert total("env/misbehaving-tools/tool_calls/mean") > 0
    assert total("env/misbehaving-tools/tool_errors") > 0
    assert total("env/misbehaving-tools/trained_samples") > 0
