"""prime-rl's example configs of its three multi-turn environments (alphabet-sort, wordle,
wiki-search), in prime-rl's own current layout (tests/fixtures/prime_rl/examples/), run by `rl`
after `rl env install` of our package of the same name: only the model path is changed (to our
shipped tiny model of that environment) and wordle's id (`wordle-v1`, the hub's) points at our
`wordle` package.

The flags added on the command line size the run to this machine (2 CPU cores, no GPU), as a
user trying a GPU config on a laptop would: one inference replica and one trainer process
instead of prime-rl's GPU counts, a small batch, two steps, wandb offline."""

import subprocess
import tomllib

import pytest
from e2e_support import BIN, REPO, RlLaunch, alive_groups, run_rows

pytestmark = pytest.mark.slow

FIXTURES = REPO / "tests" / "fixtures" / "prime_rl" / "examples"
MAX_STEPS = 2
FIT_TO_TWO_CPU_CORES = [
    "--max-steps", str(MAX_STEPS),
    "--seq-len", "1024",
    "--deployment.num-train-gpus", "1",
    "--deployment.num-infer-gpus", "1",  # prime-rl's examples name 6 (and wordle's dp 6)
    "--deployment.num-infer-replicas", "1",
    "--orchestrator.batch-size", "8",
    "--orchestrator.group-size", "4",
    "--inference.vllm.cpu-kv-cache-bytes", "256MiB",
    "--inference.vllm.enforce-eager", "true",
]  # fmt: skip

EXAMPLES = {
    # prime-rl example -> (our package folder, the model it starts from, prime-rl's id -> ours)
    "alphabet-sort": ("alphabet_sort", "examples/alphabet-sort/model", {}),
    "wordle": ("wordle", "examples/wordle/model", {"wordle-v1": "wordle"}),
    "wiki-search": ("wiki_search", "examples/wiki-search/model", {}),
}


def adapted(name: str, tmp_path) -> tuple:
    """prime-rl's config with only the model path (and a hub id) changed, written to tmp_path."""
    package, model, ids = EXAMPLES[name]
    text = (FIXTURES / f"{name}-rl.toml").read_text()
    prime_model = tomllib.loads(text)["model"]["name"]
    text = text.replace(f'name = "{prime_model}"', f'name = "{REPO / model}"')
    for prime_id, ours in ids.items():
        text = text.replace(f'"{prime_id}"', f'"{ours}"')
    config = tmp_path / f"{name}-rl.toml"
    config.write_text(text)
    return config, package


@pytest.mark.parametrize("name", list(EXAMPLES))
def test_prime_rl_example_config_runs_after_rl_env_install(name, tmp_path, monkeypatch):
    config, package = adapted(name, tmp_path)
    install = subprocess.run(
        [str(BIN / "rl"), "env", "install", str(REPO / "environments" / package)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert install.returncode == 0, install.stdout + install.stderr
    env_id = EXAMPLES[name][2].get(f"{name}-v1", name)
    assert f'id = "{env_id}"' in install.stdout, install.stdout

    monkeypatch.setenv("WANDB_MODE", "offline")
    run = RlLaunch(tmp_path / "out", name, *FIT_TO_TWO_CPU_CORES, config=config)
    try:
        assert run.wait() == 0, run.output()[-4000:]
    finally:
        run.kill()
    assert alive_groups(run.run_dir) == []
    rows = run_rows(run.run_dir)
    assert [s for s in sorted(rows) if "loss" in rows[s]] == list(range(1, MAX_STEPS + 1))
    # the environment of prime-rl's config is the one that played (its per-env metrics)
    assert all(f"env/{env_id}/reward/mean" in rows[s] for s in range(1, MAX_STEPS + 1)), rows
    # prime-rl's console lines about its keys, so a user sees what was mapped
    assert "rl: prime-rl key" in run.output()
