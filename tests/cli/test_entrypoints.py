"""Entry-point contract: parse, log, then import the service's `run` lazily and fail clearly."""

import subprocess
import sys

from cli_helpers import error_text

LOAD = "from rlbus.runtime import load_service_run; load_service_run({module!r}, 'demo')"


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
        "rlbus_trainer.entrypoint, rlbus_trainer.sft_entrypoint, rlbus.launch.rl, rlbus.launch.sft\n"
        "heavy = {'torch', 'vllm', 'transformers', 'rlbus_inference.service', "
        "'rlbus_orchestrator.service', 'rlbus_trainer.service', 'rlbus_trainer.sft'}\n"
        "print(sorted(heavy & set(sys.modules)))"
    )

    result = run_python(code, tmp_path)

    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
