"""A two-rank (gloo) FSDP2 engine publishes a version as safetensors shards, tensor by tensor:
the shards hold the model the old full gather gives, verify against the published checksums,
and load as a Hugging Face checkpoint."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load_file

from rlbus.checksums import verify_files

SCRIPT = textwrap.dedent(
    """
    import asyncio, json, sys
    import torch
    from rlbus.configs.trainer import TrainerConfig
    from rlbus_trainer.engine import build_engine, setup_distributed, teardown_distributed
    from rlbus_trainer.weights import FilesystemWeightPublisher

    config = TrainerConfig.model_validate(json.loads(open(sys.argv[1]).read()))
    out, report = sys.argv[2], sys.argv[3]
    world = setup_distributed()
    try:
        engine = build_engine(config, world)
        with torch.no_grad():  # weights unlike the source files: the shards must carry these
            for param in engine.model.parameters():
                param.add_(0.5)
        publisher = FilesystemWeightPublisher(config, bus=None, run_dir=out, world=world)

        async def fresh(step):  # no bus here: every version is new
            return False

        publisher._stale = fresh
        files = asyncio.run(publisher.write_version(1, engine, publisher.root / "step_1"))
        full = engine.full_state_dict()  # the old path: the whole model gathered on rank 0
        if world.is_main:
            from safetensors.torch import load_file
            shards = {}
            for f in files:
                if f.name.endswith(".safetensors"):
                    shards.update(load_file(publisher.root / "step_1" / f.name))
            same = sorted(n for n in shards if torch.equal(shards[n], full[n]))
            open(report, "w").write(json.dumps({
                "files": [[f.name, f.sha256] for f in files],
                "same_as_full_gather": same,
                "num_shards": sum(f.name.endswith(".safetensors") for f in files),
            }))
    finally:
        # a rank that exits with its gloo group alive can abort in the group's destructor
        teardown_distributed()
    """
)


@pytest.mark.slow
def test_two_fsdp_ranks_publish_shards_that_load_as_the_model(tiny_model, tmp_path):
    (tmp_path / "publish.py").write_text(SCRIPT)
    config = {"model": {"name": str(tiny_model)}, "weight_broadcast": {"max_shard_size": 100_000}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    argv = [
        *(sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"),
        *(str(tmp_path / n) for n in ("publish.py", "config.json", "run", "report.json")),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    out = tmp_path / "run" / "broadcasts" / "step_1"

    verify_files(out, dict(report["files"]))
    assert report["num_shards"] > 1 and (out / "model.safetensors.index.json").is_file()
    source = load_file(tiny_model / "model.safetensors")  # the 1-rank state before the +0.5
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["weight_map"].keys() == source.keys()  # tied lm_head left out, as in the source
    assert sorted(report["same_as_full_gather"]) == sorted(source)

    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(out).state_dict()
    for name, tensor in source.items():
        torch.testing.assert_close(loaded[name], tensor.to(loaded[name].dtype) + 0.5)
