"""Entry-point contract: parse, log, then import the service's `run` lazily and fail clearly."""

import importlib
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from cli_helpers import REPO, error_text

LOAD = "from rlbus.lifecycle import load_service_run; load_service_run({module!r}, 'demo')"


def run_python(code: str, tmp_path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )


def test_missing_service_module_fails_with_a_message_not_a_traceback(tmp_path):
    result = run_python(LOAD.format(module="rlbus_not_installed.service"), tmp_path)

    assert result.returncode == 3
    assert "rlbus_not_installed.service.run does not exist" in error_text(result)
    assert "Traceback" not in result.stderr


def test_service_module_without_run_fails_the_same_way(tmp_path):
    (tmp_path / "half_service.py").write_text("x = 1\n")

    result = run_python(LOAD.format(module="half_service"), tmp_path)

    assert result.returncode == 3 and "half_service.run does not exist" in error_text(result)


def test_a_missing_dependency_inside_the_service_keeps_its_traceback(tmp_path):
    (tmp_path / "broken_service.py").write_text("import dependency_that_is_not_installed\n")

    result = run_python(LOAD.format(module="broken_service"), tmp_path)

    assert result.returncode == 1
    assert (
        "ModuleNotFoundError: No module named 'dependency_that_is_not_installed'" in result.stderr
    )


def test_entry_point_modules_import_no_service_body(tmp_path):
    code = (
        "import sys, rlbus_inference.entrypoint, rlbus_orchestrator.entrypoint, "
        "rlbus_trainer.entrypoint, rlbus_trainer.sft_entrypoint, rlbus_launch.rl, rlbus_launch.sft\n"
        "heavy = {'torch', 'vllm', 'transformers', 'rlbus_inference.service', "
        "'rlbus_orchestrator.service', 'rlbus_trainer.service', 'rlbus_trainer.sft'}\n"
        "print(sorted(heavy & set(sys.modules)))"
    )

    result = run_python(code, tmp_path)

    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


# --- every entry point declared in a pyproject.toml --------------------------------------------


def workspace_pyprojects() -> list[Path]:
    """The root pyproject.toml and those of its uv workspace members (read, not listed here)."""
    root = REPO / "pyproject.toml"
    members = tomllib.loads(root.read_text())["tool"]["uv"]["workspace"]["members"]
    return [root, *(REPO / member / "pyproject.toml" for member in members)]


def declared_entry_points() -> list[tuple[str, str, str]]:
    """(group, name, "module:attr") for every [project.scripts] and [project.entry-points.*]."""
    found = []
    for path in workspace_pyprojects():
        project = tomllib.loads(path.read_text()).get("project", {})
        groups = {"console_scripts": project.get("scripts", {}), **project.get("entry-points", {})}
        for group, entries in groups.items():
            found += [(group, name, target) for name, target in entries.items()]
    return found


def test_the_workspace_declares_the_service_commands():
    scripts = {name for group, name, _ in declared_entry_points() if group == "console_scripts"}
    assert {"rl", "inference", "orchestrator", "trainer"} <= scripts


@pytest.mark.parametrize(
    ("group", "name", "target"), declared_entry_points(), ids=lambda v: str(v).split(":")[0]
)
def test_every_entry_point_names_an_existing_object(group, name, target):
    module_name, _, attr = target.partition(":")
    module = importlib.import_module(module_name)
    assert callable(getattr(module, attr, None)), f"{group} {name} = {target!r}: no {attr} there"


def test_every_console_script_answers_help():
    """Each script run the way its installed wrapper runs it (import module, call the function),
    straight from the pyproject text, so a stale venv cannot hide a broken entry. In parallel:
    each costs a Python start-up and the config imports."""
    scripts = [(n, t) for g, n, t in declared_entry_points() if g == "console_scripts"]
    env = {**os.environ, "COLUMNS": "200", "NO_COLOR": "1"}
    procs = {
        name: subprocess.Popen(
            [sys.executable, "-c", wrapper(name, target), "--help"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for name, target in scripts
    }
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, (name, err[-2000:])
        assert "usage" in out.lower(), (name, out[:500])


def wrapper(name: str, target: str) -> str:
    module, _, attr = target.partition(":")
    return WRAPPER.format(module=module, attr=attr, name=name)


# What the console-script wrapper of pip/uv does: argv[0] is the script's name.
WRAPPER = "import sys; from {module} import {attr}; sys.argv[0] = {name!r}; sys.exit({attr}())"
