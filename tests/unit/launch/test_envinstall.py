"""`rl env install` / `rl env list` (rlbus_launch.envinstall) against a fake uv that records its
arguments: where a package goes (its declared verifiers), what is recorded, the lines printed and
the one-line errors. The real install (a venv from PyPI) is
tests/integration/orchestrator/test_rl_env_install.py."""

import json
import sys
import textwrap

import pytest

from rlbus import envindex
from rlbus_launch import envinstall
from rlbus_launch.envinstall import Source, main, parse_source

FAKE_UV = """\
#!{python}
import json, os, pathlib, sys
args = sys.argv[1:]
with open(os.environ["FAKE_UV_LOG"], "a") as log:
    log.write(json.dumps(args) + "\\n")
if os.environ.get("FAKE_UV_FAIL"):
    sys.exit("error: No solution found when resolving dependencies\\n  cause: not found: my-env")
if args[0] == "venv":
    python = pathlib.Path(args[-1]) / "bin" / "python"
    python.parent.mkdir(parents=True, exist_ok=True)
    python.write_text("#!/bin/sh\\nexec {python} \\"$@\\"\\n")
    python.chmod(0o755)
if "--target" in args:
    info = pathlib.Path(args[args.index("--target") + 1]) / "my_env-0.3.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(os.environ["FAKE_UV_METADATA"])
"""


@pytest.fixture
def uv(tmp_path, monkeypatch):
    """A fake uv on $UV; `uv.calls()` lists the argument lists it was run with."""
    script = tmp_path / "uv"
    script.write_text(FAKE_UV.format(python=sys.executable))
    script.chmod(0o755)
    log = tmp_path / "uv.log"
    monkeypatch.setenv("UV", str(script))
    monkeypatch.setenv("FAKE_UV_LOG", str(log))
    monkeypatch.setenv(
        "FAKE_UV_METADATA",
        "Metadata-Version: 2.1\nName: my-env\nVersion: 0.3.0\nRequires-Dist: verifiers>=0.4.1\n",
    )

    class Calls:
        def calls(self):
            return (
                [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
            )

    return Calls()


def make_package(root, name="my-v1-env", dependencies=('"verifiers==0.4.0"',)):
    """A local environment package: pyproject.toml and its module (importable by the env venv's
    python through PYTHONPATH, as an editable install would make it)."""
    package = root / name.replace("-", "_")
    (package / name.replace("-", "_")).mkdir(parents=True)
    (package / name.replace("-", "_") / "__init__.py").write_text("")
    (package / "pyproject.toml").write_text(
        textwrap.dedent(f"""
        [project]
        name = "{name}"
        version = "0.1.0"
        dependencies = [{", ".join(dependencies)}]
        """)
    )
    return package


@pytest.mark.parametrize(
    ("requirement", "own_venv"),
    [
        ("verifiers==0.4.0", True),
        ("verifiers>=0.4", True),
        ("verifiers[rl]~=0.4.2", True),
        ("verifiers>=0.5,<1 ; python_version >= '3.11'", True),
        ("verifiers==0.4.*", True),
        ("verifiers>=0.1.3", False),
        ("verifiers<0.4", False),
        ("verifiers>0.3", False),
        ("verifiers", False),
        ("verifiers @ git+https://github.com/PrimeIntellect-ai/verifiers", False),
    ],
)
def test_only_a_lower_bound_of_verifiers_0_4_asks_for_an_own_venv(requirement, own_venv):
    assert envinstall.needs_verifiers_v1(requirement) is own_venv


def test_the_verifiers_requirement_of_an_extra_is_not_needed():
    requires = ["numpy", "verifiers>=0.4; extra == 'dev'", "Verifiers>=0.2"]
    assert envinstall.verifiers_requirement(requires) == "Verifiers>=0.2"
    assert envinstall.verifiers_requirement(["numpy"]) is None


def test_sources_are_directories_hub_ids_or_requirements(tmp_path, monkeypatch):
    package = make_package(tmp_path)
    monkeypatch.chdir(tmp_path)

    assert parse_source("my_v1_env") == Source("my_v1_env", path=package.resolve())
    assert parse_source("my-env==0.2").uv_args() == ["my-env==0.2"]
    hub = parse_source("primeintellect/wordle@0.1.4")
    assert hub.uv_args() == [
        "wordle==0.1.4",
        "--extra-index-url",
        "https://hub.primeintellect.ai/primeintellect/simple/",
    ]
    assert parse_source(str(package)).uv_args() == ["-e", str(package.resolve())]


@pytest.mark.parametrize(
    ("text", "error"),
    [
        (".", "no pyproject.toml in it"),
        ("./no/such/dir", "no such directory"),
        ("/no/such", "no such directory"),
        ("!x", "neither a directory nor a package name"),
    ],
)
def test_a_bad_source_is_one_line(tmp_path, monkeypatch, capsys, uv, text, error):
    monkeypatch.chdir(tmp_path)

    assert main(["install", text, "--venv-dir", str(tmp_path / "envs")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("rl env install: error: ") and error in err and err.count("\n") == 1
    assert uv.calls() == []


def test_a_verifiers_0_4_package_gets_a_venv_of_its_own_and_an_index_entry(
    tmp_path, monkeypatch, capsys, uv
):
    package = make_package(tmp_path)
    monkeypatch.setenv("PYTHONPATH", str(package))
    envs = tmp_path / "envs"

    assert main(["install", str(package), "--venv-dir", str(envs), "--python", "3.11"]) == 0

    python = envs / "my-v1-env" / "bin" / "python"
    assert uv.calls() == [
        ["venv", "-q", "--clear", "-p", "3.11", str(envs / "my-v1-env")],
        ["pip", "install", "-q", "--python", str(python), "-e", str(package.resolve())],
    ]
    entry = envindex.find_installed("my-v1-env", envs)
    assert entry == envindex.InstalledEnv(
        id="my-v1-env",
        kind="vf",
        python=str(python),
        taskset_id="my-v1-env",
        source=str(package.resolve()),
        editable=True,
        package="my-v1-env",
        version="0.1.0",
    )
    out = capsys.readouterr().out.splitlines()
    assert out[0] == (
        "rl env install: my-v1-env 0.1.0 requires verifiers==0.4.0: installing into its own venv "
        "(verifiers 0.4: served by verifiers' env server)"
    )
    assert all(line.startswith("rl env install: ") for line in out[:-2])
    assert out[-2] == 'my-v1-env is installed: set `id = "my-v1-env"` in [[orchestrator.env]]'
    assert out[-1] == f"(run rl with RLBUS_ENV_DIR={envs} so that it finds the index)"


def test_installing_again_reuses_the_venv_and_updates_the_entry(tmp_path, monkeypatch, uv):
    package = make_package(tmp_path)
    monkeypatch.setenv("PYTHONPATH", str(package))
    envs = tmp_path / "envs"
    main(["install", str(package), "--venv-dir", str(envs)])
    text = (package / "pyproject.toml").read_text()
    (package / "pyproject.toml").write_text(text.replace('"0.1.0"', '"0.2.0"'))

    assert main(["install", str(package), "--venv-dir", str(envs)]) == 0

    assert [call[0] for call in uv.calls()] == ["venv", "pip", "pip"]
    assert envindex.find_installed("my-v1-env", envs).version == "0.2.0"


def test_a_named_package_is_probed_alone_then_installed_and_upgraded(
    tmp_path, monkeypatch, capsys, uv
):
    monkeypatch.setenv(envindex.ENV_DIR_VAR, str(tmp_path / "envs"))
    module = tmp_path / "mods" / "my_env"
    module.mkdir(parents=True)
    (module / "__init__.py").write_text("")
    monkeypatch.setenv("PYTHONPATH", str(module.parent))

    assert main(["install", "my-env==0.3.0"]) == 0

    probe, venv, pip = uv.calls()
    assert probe[:4] == ["pip", "install", "-q", "--no-deps"] and probe[-1] == "my-env==0.3.0"
    assert venv[0] == "venv"
    assert pip[-3:] == ["my-env==0.3.0", "--upgrade-package", "my-env"]
    assert envindex.find_installed("my-env").source == "my-env==0.3.0"
    assert (
        capsys.readouterr()
        .out.splitlines()[-1]
        .startswith('my-env is installed: set `id = "my-env"`')
    )


def test_a_classic_verifiers_package_gets_a_venv_of_its_own_of_kind_classic(
    tmp_path, monkeypatch, capsys, uv
):
    package = make_package(tmp_path, "my-classic-env", dependencies=('"verifiers==0.1.3"',))
    monkeypatch.setenv("PYTHONPATH", str(package))
    envs = tmp_path / "envs"

    assert main(["install", str(package), "--venv-dir", str(envs)]) == 0

    entry = envindex.find_installed("my-classic-env", envs)
    assert (entry.kind, entry.taskset_id) == ("classic", "my-classic-env")
    assert entry.python == str(envs / "my-classic-env" / "bin" / "python")
    out = capsys.readouterr().out
    assert "installing into its own venv (classic verifiers: served by rlbus's classic" in out


def test_other_packages_go_into_rlbus_venv_and_leave_no_entry(tmp_path, monkeypatch, capsys, uv):
    package = make_package(tmp_path, "my-env", dependencies=('"numpy"',))
    envs = tmp_path / "envs"
    envindex.record(envindex.InstalledEnv("my-env", "vf", "/old/python", "my-env", "/old"), envs)
    monkeypatch.setattr(envinstall, "ids_in_this_venv", lambda package: ["my-env"])
    monkeypatch.setattr(envinstall.importlib.util, "find_spec", lambda name: object())

    assert main(["install", str(package), "--venv-dir", str(envs)]) == 0

    assert uv.calls() == [
        ["pip", "install", "-q", "--python", sys.executable, "-e", str(package.resolve())]
    ]
    assert envindex.read_index(envs) == {}  # the stale own-venv record would shadow nothing now
    out = capsys.readouterr().out
    assert "my-env 0.1.0 does not require verifiers: installing into rlbus's venv" in out
    assert (
        out.splitlines()[-1] == 'my-env is installed: set `id = "my-env"` in [[orchestrator.env]]'
    )


def test_own_venv_forces_a_venv_for_a_package_that_does_not_say_verifiers_0_4(
    tmp_path, monkeypatch, uv
):
    package = make_package(tmp_path, dependencies=('"verifiers @ git+https://x/verifiers"',))
    monkeypatch.setenv("PYTHONPATH", str(package))

    assert main(["install", str(package), "--own-venv", "--venv-dir", str(tmp_path / "e")]) == 0
    assert envindex.find_installed("my-v1-env", tmp_path / "e") is not None


def test_a_uv_failure_is_its_last_stderr_line(tmp_path, monkeypatch, capsys, uv):
    monkeypatch.setenv("FAKE_UV_FAIL", "1")

    assert main(["install", "my-env", "--venv-dir", str(tmp_path / "envs")]) == 1

    assert capsys.readouterr().err == (
        "rl env install: error: uv pip install --no-deps my-env failed: cause: not found: my-env\n"
    )


def test_a_package_whose_venv_imports_no_module_of_its_name_is_refused(tmp_path, capsys, uv):
    package = make_package(tmp_path)  # no PYTHONPATH: the fake venv cannot import it

    assert main(["install", str(package), "--venv-dir", str(tmp_path / "envs")]) == 1

    assert "its venv imports no module my_v1_env" in capsys.readouterr().err
    assert envindex.read_index(tmp_path / "envs") == {}


def test_a_classic_package_gives_its_entry_point_ids():
    package = envinstall.Package("rlbus-orchestrator", "0", [])
    assert envinstall.ids_in_this_venv(package) == ["reverse-text"]


def test_list_names_built_ins_and_installed_envs_with_their_kinds(tmp_path, capsys):
    envindex.record(envindex.InstalledEnv("a-v1", "vf", sys.executable, "a-v1", "/src/a"), tmp_path)
    envindex.record(envindex.InstalledEnv("b-v1", "vf", "/gone/python", "b-v1", "b"), tmp_path)

    assert main(["list", "--venv-dir", str(tmp_path)]) == 0

    rows = dict(line.split(maxsplit=1) for line in capsys.readouterr().out.splitlines())
    assert rows["reverse-text"] == "built-in"
    assert rows["a-v1"] == f"verifiers 0.4, own venv {sys.executable} (from /src/a)"
    assert rows["b-v1"].endswith("(from b; the venv is gone: install it again)")
