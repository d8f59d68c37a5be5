"""Resolved configs and launch scripts in the run directory.

`rl` and `sft` write, before starting anything (and instead of starting anything with `--dry-run`):

    <run_dir>/configs/<name>.toml   the fully resolved config of each service (every field)
    <run_dir>/scripts/<name>.sh     one script per process: cd, environment, exec the exact argv
    <run_dir>/scripts/launch.sh     every process in launch order, each in its own process group
                                    with output in logs/<name>.log; stops all when one exits

The launcher starts the very same argv lists, so running the scripts later repeats the launch.
"""

import shlex
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path

from pydantic import BaseModel

from rlbus.configs.base import config_to_toml
from rlbus.secrets import write_secret_file
from rlbus_launch.supervisor import ServiceProcess

CONFIGS_DIR = "configs"
SCRIPTS_DIR = "scripts"
LAUNCH_ALL = "launch.sh"


def config_path(run_dir: Path, name: str) -> Path:
    return run_dir / CONFIGS_DIR / f"{name}.toml"


LAUNCHER_CONFIGS = frozenset({"rl"})
"""Written with only the explicitly set values (files, flags, run name): relaunching from them
(`rl @ configs/rl.toml --resume --max-steps 200`) pushes shared values down again, which a fully
expanded copy would pin. The service configs are written in full."""


def write_configs(run_dir: Path, configs: Mapping[str, BaseModel]) -> list[Path]:
    """`<run_dir>/configs/<name>.toml` for each config; returns the paths."""
    paths = []
    for name, config in configs.items():
        path = config_path(run_dir, name)
        path.parent.mkdir(parents=True, exist_ok=True)
        if name in LAUNCHER_CONFIGS:
            header = f"# {type(config).__name__} of this run: the values set by files, flags and the launcher.\n"
            text = config_to_toml(config, exclude_unset=True)
        else:
            header = f"# Resolved {type(config).__name__} of this run (every field).\n"
            text = config_to_toml(config)
        path.write_text(header + text)
        paths.append(path)
    return paths


def render_process_script(process: ServiceProcess, command: str) -> str:
    """A bash script that repeats one process's launch: same directory, environment and argv."""
    lines = [
        "#!/usr/bin/env bash",
        f"# {process.name}: written by `{command}` at {datetime.now(UTC):%Y-%m-%d %H:%M:%S} UTC.",
        "# Running it starts this process exactly as the launcher does.",
        "set -euo pipefail",
    ]
    if process.cwd is not None:
        lines.append(f"cd {shlex.quote(str(process.cwd))}")
    for key, value in sorted(process.env.items()):
        lines.append(f"export {key}={shlex.quote(value)}")
    lines.append("exec " + shlex.join(process.argv))
    return "\n".join(lines) + "\n"


def render_launch_all(processes: list[ServiceProcess], command: str) -> str:
    """A bash script that starts every process like the launcher (own process group, output in
    its log file) and stops them all, last started first, when one exits or on Ctrl-C."""
    lines = [
        "#!/usr/bin/env bash",
        f"# All processes of this run, in launch order; written by `{command}`.",
        "set -uo pipefail",
        'here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"',
        "pids=()",
        "stop_all() {",
        "  # last started first: SIGTERM each process group, give it 20 s, then SIGKILL the group",
        "  for ((i=${#pids[@]}-1; i>=0; i--)); do",
        '    kill -TERM -- "-${pids[i]}" 2>/dev/null || continue',
        '    for _ in $(seq 200); do kill -0 -- "-${pids[i]}" 2>/dev/null || break; sleep 0.1; done',
        '    kill -KILL -- "-${pids[i]}" 2>/dev/null',
        "  done",
        "  wait",
        "}",
        "trap stop_all EXIT",
        "trap 'exit 130' INT TERM",
    ]
    cwd = next((p.cwd for p in processes if p.cwd is not None), None)
    if cwd is not None:
        lines.append(f"cd {shlex.quote(str(cwd))}")
    for process in processes:
        log = shlex.quote(str(process.log_path))
        lines.append(f"mkdir -p {shlex.quote(str(process.log_path.parent))}")
        lines.append(f'setsid bash "$here/{process.name}.sh" >> {log} 2>&1 &')
        lines.append('pids+=("$!")')
        lines.append(f'echo "started {process.name} (pid $!, log {process.log_path})"')
    lines += ['wait -n "${pids[@]}"', "exit $?"]
    return "\n".join(lines) + "\n"


def write_scripts(run_dir: Path, processes: list[ServiceProcess], command: str) -> list[Path]:
    """One executable script per process plus `launch.sh`; returns the paths (launch.sh last)."""
    scripts_dir = run_dir / SCRIPTS_DIR
    scripts_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for process in processes:
        path = scripts_dir / f"{process.name}.sh"
        path.write_text(render_process_script(process, command))
        path.chmod(0o755)
        paths.append(path)
    launch_all = scripts_dir / LAUNCH_ALL
    launch_all.write_text(render_launch_all(processes, command))
    launch_all.chmod(0o755)
    return [*paths, launch_all]


def describe_written(run_dir: Path, configs: list[Path], scripts: list[Path]) -> str:
    """The message a dry run prints: where everything went and how to start it."""
    lines = [f"Run directory: {run_dir}", "Resolved configs:"]
    lines += [f"  {path}" for path in configs]
    lines.append("Launch scripts (one per process):")
    lines += [f"  {path}" for path in scripts[:-1]]
    lines.append(f"Start everything with: bash {scripts[-1]}")
    return "\n".join(lines)


def write_launch(
    run_dir: Path,
    configs: Mapping[str, BaseModel],
    processes: list[ServiceProcess],
    command: str,
    files: dict[str, str] | None = None,
    secret_files: dict[Path, str] | None = None,
) -> tuple[list[Path], list[Path]]:
    """Write the configs (plus extra files such as `nats.conf`, 0600: a server config holds its
    credentials), the 0600 secret files and the scripts of one launch."""
    written = write_configs(run_dir, configs)
    for name, text in (files or {}).items():
        written.append(write_secret_file(run_dir / CONFIGS_DIR / name, text))
    for path, secret in (secret_files or {}).items():
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        write_secret_file(path, secret)
    return written, write_scripts(run_dir, processes, command)
