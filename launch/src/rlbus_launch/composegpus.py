"""`rl compose-gpus @ CONFIG [flags] [--out FILE]`: the compose GPU override of a run, from the
same split as `rl` and the SLURM job (rlbus.placement.place_gpus; docs/compose.md, "GPUs"), and
`resolve` plans the run from the same config and flags.

    rl compose-gpus @ examples/reverse-text/rl.toml --deployment.gpu-ids '[0,1]' \\
        --out deploy/docker-compose.gpu.yml
    docker compose -f deploy/docker-compose.yml -f deploy/docker-compose.gpu.yml up

The override switches `inference` and `trainer` to the CUDA images and reserves each its own
devices: one compose service per inference replica (`inference`, then `inference-1`, ... built
with `extends` from the base file, each with its replica's config `configs/inference-<i>.toml`),
and the trainer's torchrun with one rank per trainer GPU. `deploy/docker-compose.gpu.yml` is this
command's output for the default 1 + 1 split (tests/unit/launch/test_compose_gpus.py keeps it so).
Without `--deployment.gpu-ids` the GPUs of this host are split. Exit 0 with the file written (or
printed), 2 with one line when the split cannot work.
"""

import json
import sys
from pathlib import Path

from rlbus.configs import RLConfig
from rlbus.configs.base import parse_cli
from rlbus.configs.rl import gpu_placement
from rlbus.placement import GpuPlacement, PlacementError, detected_gpus

PROG = "rl compose-gpus"
BASE_FILE = "docker-compose.yml"
"""The base compose file, next to the override (`extends` names it relative to the override)."""
INFERENCE_FLAGS = [
    "--exit-when-finished",
    "--bus.user", "inference", "--bus.password-file", "/secrets/inference.password",
    "--metrics.host", "0.0.0.0", "--metrics.port", "9100",
]  # fmt: skip
"""The base file's inference flags after the config (the test compares them with the file)."""
CONFIGS = "/outputs/${RLBUS_RUN:-compose}/configs"


def _devices(ids: tuple[int, ...]) -> dict:
    device = {"driver": "nvidia", "device_ids": [str(i) for i in ids], "capabilities": ["gpu"]}
    return {"resources": {"reservations": {"devices": [device]}}}


def _build(target: str) -> dict:
    return {"context": "..", "dockerfile": "deploy/Dockerfile", "target": target}


def resolve_environment(args: list[str]) -> dict:
    """The `resolve` service plans the run from the same config and flags as this override (its
    replica configs and their count match the devices); flags given at `up` time
    (RLBUS_ARGS) still come last and win."""
    flags = list(args)
    environment = {}
    if "@" in flags and flags.index("@") + 1 < len(flags):
        at = flags.index("@")
        environment["RLBUS_CONFIG"] = flags[at + 1]
        del flags[at : at + 2]
    environment["RLBUS_ARGS"] = " ".join([*flags, "${RLBUS_ARGS:-}"])
    return {"environment": environment}


def override(placement: GpuPlacement, args: list[str]) -> dict:
    """The compose override of `placement` as a mapping (services -> settings); `args`: the
    config and flags it was made from."""
    services: dict[str, dict] = {"resolve": resolve_environment(args)}
    count = len(placement.inference)
    for i, devices in enumerate(placement.inference):
        name = "inference" if i == 0 else f"inference-{i}"
        service: dict = {} if i == 0 else {"extends": {"file": BASE_FILE, "service": "inference"}}
        service["image"] = "rlbus-inference-cuda:${RLBUS_TAG:-latest}"
        service["build"] = _build("inference-cuda")
        if count > 1:  # the dry run writes one config per replica (ports, replica id)
            service["command"] = ["@", f"{CONFIGS}/inference-{i}.toml", *INFERENCE_FLAGS]
        service["deploy"] = _devices(devices)
        services[name] = service
    nproc = str(len(placement.trainer))
    services["trainer"] = {
        "image": "rlbus-trainer-cuda:${RLBUS_TAG:-latest}",
        "build": _build("trainer-cuda"),
        "entrypoint": ["python", "-m", "torch.distributed.run", "--standalone",
                       "--nproc-per-node", nproc, "-m", "rlbus_trainer.entrypoint"],
        "deploy": _devices(placement.trainer),
    }  # fmt: skip
    return {"services": services}


def to_yaml(value: object, indent: int = 0) -> str:
    """Block YAML of nested dicts and lists of strings (strings JSON-quoted: valid YAML)."""
    pad = " " * indent
    if isinstance(value, dict):
        lines = []
        for key, item in value.items():
            flow = isinstance(item, list) and all(isinstance(x, str) for x in item)
            if isinstance(item, dict | list) and item and not flow:
                lines.append(f"{pad}{key}:\n{to_yaml(item, indent + 2)}")
            else:
                lines.append(f"{pad}{key}: {json.dumps(item)}")
        return "\n".join(lines)
    assert isinstance(value, list)
    return "\n".join(f"{pad}- {to_yaml(item, indent + 2).lstrip()}" for item in value)


def render(config: RLConfig, args: list[str]) -> str:
    """The override file's text for `config`, parsed from `args`."""
    gpu_ids = config.deployment.gpu_ids
    placement = gpu_placement(config, gpu_ids if gpu_ids is not None else detected_gpus())
    split = "; ".join(
        [f"replica {i}: GPUs {list(r)}" for i, r in enumerate(placement.inference)]
        + [f"trainer: GPUs {list(placement.trainer)}"]
    )
    header = [
        f"# Generated by `{PROG} {' '.join(args)}`: do not edit; run it again (docs/compose.md).",
        f"# {split}",
        f"#   docker compose -f deploy/{BASE_FILE} -f deploy/docker-compose.gpu.yml up",
    ]
    return "\n".join(header) + "\n" + to_yaml(override(placement, args)) + "\n"


def split_out(argv: list[str]) -> tuple[list[str], Path | None]:
    """`--out FILE` taken out of the config flags."""
    if "--out" not in argv:
        return argv, None
    at = argv.index("--out")
    if at + 1 >= len(argv):
        raise SystemExit(f"{PROG}: --out needs a file path")
    return argv[:at] + argv[at + 2 :], Path(argv[at + 1])


def main(argv: list[str]) -> int:
    args, out = split_out(argv)
    config = parse_cli(RLConfig, args, prog=PROG)
    try:
        text = render(config, args)
    except PlacementError as error:
        print(f"{PROG}: {error}", file=sys.stderr)
        return 2
    if out is None:
        sys.stdout.write(text)
    else:
        out.write_text(text, encoding="utf-8")
        print(out)
    return 0
