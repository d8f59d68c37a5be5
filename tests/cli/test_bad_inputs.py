"""Every bad input is one clear line (issue 15, item 6): the culprit (flag, field or file) and its
value named, the documented exit code, no traceback, and nothing of an existing run touched.

Two tiers of the same contract:
- `CONFIG_CASES`: config files, flags, values and cross-field rules, loaded in-process the way
  every entry point loads them (`parse_cli`, then `exit_if_paths_missing`), so ~90 cases cost a
  second;
- `COMMAND_CASES`: the real console scripts (`rl`, `sft`, `inference`, `orchestrator`,
  `trainer`) as subprocesses, on paths that fail before anything heavy starts, each next to an
  existing run directory that must come out byte for byte unchanged.
"""

import hashlib
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from cli_helpers import REPO, error_text, run_command

from rlbus.bus.errors import BusAuthError, BusConnectError
from rlbus.configs import (
    InferenceConfig,
    OrchestratorConfig,
    RLConfig,
    SFTConfig,
    TrainerConfig,
)
from rlbus.configs.base import parse_cli
from rlbus.configs.paths import exit_if_paths_missing
from rlbus.lifecycle import Terminated, errors_in_one_line
from rlbus.netutil import free_port

TINY_MODEL = REPO / "examples" / "reverse-text" / "model"
"""A saved model directory that ships with the repo (config.json included)."""


@dataclass
class Case:
    """One bad input: the command's config class, its argv, the files it needs (name -> text or
    bytes; a name ending in / is a directory), the substrings stderr must contain."""

    id: str
    cls: type
    args: list[str]
    expect: list[str]
    files: dict[str, str | bytes] = field(default_factory=dict)
    strict: bool = True
    """Path checks as a launch (True) or a dry run (False) does them."""


RL, SFT, TRAINER, ORCH, INFER = (
    RLConfig,
    SFTConfig,
    TrainerConfig,
    OrchestratorConfig,
    InferenceConfig,
)

CONFIG_CASES = [
    # --- config files that cannot be loaded ---
    Case("file-is-directory", RL, ["@", "conf/"], ["conf", "is a directory"], {"conf/": ""}),
    Case("file-binary", RL, ["@", "b.toml"], ["b.toml", "is binary"], {"b.toml": b"\0\1\2\xff"}),
    Case(
        "file-not-utf8", RL, ["@", "l.toml"], ["l.toml", "not UTF-8"], {"l.toml": b"a = '\xe9'\n"}
    ),
    Case("file-empty-toml", RL, ["@", "e.toml"], ["e.toml", "is empty"], {"e.toml": ""}),
    Case("file-empty-yaml", RL, ["@", "e.yaml"], ["e.yaml", "is empty"], {"e.yaml": "\n"}),
    Case("file-blank-json", RL, ["@", "e.json"], ["e.json", "is empty"], {"e.json": "  \n"}),
    Case(
        "json-top-list", RL, ["@", "l.json"], ["l.json", "a list, not a table"], {"l.json": "[1]"}
    ),
    Case(
        "json-top-string",
        RL,
        ["@", "s.json"],
        ["s.json", "a string, not a table"],
        {"s.json": '"x"'},
    ),
    Case(
        "json-top-number", RL, ["@", "n.json"], ["n.json", "a number, not a table"], {"n.json": "7"}
    ),
    Case(
        "yaml-top-list", RL, ["@", "l.yaml"], ["l.yaml", "a list, not a table"], {"l.yaml": "- a"}
    ),
    Case("yaml-top-scalar", RL, ["@", "s.yml"], ["s.yml", "not a table"], {"s.yml": "hello"}),
    Case("toml-invalid", RL, ["@", "x.toml"], ["x.toml", "invalid TOML"], {"x.toml": "a = \n"}),
    Case("json-invalid", RL, ["@", "x.json"], ["x.json", "invalid JSON"], {"x.json": "{bad"}),
    Case("yaml-invalid", RL, ["@", "x.yaml"], ["x.yaml", "invalid YAML"], {"x.yaml": "a: [\n"}),
    Case("file-missing", RL, ["@", "nope.toml"], ["nope.toml", "not found"]),
    Case("file-suffix", RL, ["@", "c.ini"], ["c.ini", "unsupported type '.ini'"], {"c.ini": "a=1"}),
    Case("file-no-suffix", RL, ["@", "conf"], ["conf", "(no suffix)"], {"conf": "a = 1"}),
    Case("at-sign-last", RL, ["--max-steps", "3", "@"], ["`@` must be followed by a config file"]),
    Case("at-sign-then-flag", RL, ["@", "--max-steps", "3"], ["`@` must be followed"]),
    Case(
        "sub-file-is-directory", RL, ["--monitors.wandb", "@", "w/"], ["w", "directory"], {"w/": ""}
    ),
    # --- keys in files: unknown (did you mean), wrong type ---
    Case(
        "file-unknown-key",
        RL,
        ["@", "c.toml"],
        ["--max-step: unknown option", "did you mean --max-steps?"],
        {"c.toml": "max_step = 3\n"},
    ),
    Case(
        "file-unknown-nested-key",
        RL,
        ["@", "c.toml"],
        ["--orchestrator.batchsize: unknown option", "did you mean --orchestrator.batch-size?"],
        {"c.toml": "[orchestrator]\nbatchsize = 8\n"},
    ),
    Case(
        "yaml-unknown-key",
        SFT,
        ["@", "c.yaml"],
        ["--data.pth: unknown option", "did you mean --data.path?"],
        {"c.yaml": "data:\n  pth: x.jsonl\n"},
    ),
    Case(
        "file-wrong-type",
        RL,
        ["@", "c.toml"],
        ["--max-steps", "'ten'"],
        {"c.toml": 'max_steps = "ten"\n'},
    ),
    Case(
        "file-string-for-list",
        RL,
        ["@", "c.toml"],
        ["--orchestrator.env"],
        {"c.toml": '[orchestrator]\nenv = "reverse-text"\n'},
    ),
    Case(
        "file-table-for-int",
        RL,
        ["@", "c.toml"],
        ["--seq-len", "valid integer"],
        {"c.toml": "[seq_len]\na = 1\n"},
    ),
    Case(
        "file-env-weight-zero",
        RL,
        ["@", "c.toml"],
        ["--orchestrator.env[0].weight", "greater than 0"],
        {"c.toml": '[[orchestrator.env]]\nid = "reverse-text"\nweight = 0\n'},
    ),
    Case(
        "file-env-id-unknown-close",
        RL,
        ["@", "c.toml"],
        [
            "--orchestrator.env[0].id",
            "unknown environment 'revers-text'",
            "did you mean 'reverse-text'",
            "known ids: ",  # the environment packages installed in the venv are listed too
        ],
        {"c.toml": '[[orchestrator.env]]\nid = "revers-text"\n'},
    ),
    Case(
        "file-env-id-unknown-far",
        ORCH,
        ["@", "c.toml"],
        ["--env[1].id", "unknown environment 'gsm8k'", "known ids: ", "reverse-text"],
        {"c.toml": '[[env]]\nid = "reverse-text"\n\n[[env]]\nid = "gsm8k"\n'},
    ),
    Case(
        "file-env-vf-without-venv",
        RL,
        ["@", "c.toml"],
        ["--orchestrator.env[0].args", "'vf:reverse-text-v1'", "args.python", "args.address"],
        {"c.toml": '[[orchestrator.env]]\nid = "vf:reverse-text-v1"\n'},
    ),
    Case(
        "file-bad-tag",
        RL,
        ["@", "c.toml"],
        ["--trainer.optim", "'adam'"],
        {"c.toml": '[trainer.optim]\ntype = "adam"\n'},
    ),
    # --- flags: unknown, missing values, wrong types, out of range ---
    Case("flag-unknown", RL, ["--nope", "3"], ["--nope: unknown option"]),
    Case(
        "flag-typo-nested", RL, ["--trainer.max-step", "3"], ["did you mean --trainer.max-steps?"]
    ),
    Case("flag-service-clean", TRAINER, ["--clean"], ["--clean: unknown option"]),
    Case("flag-no-value-last", RL, ["--max-steps"], ["--max-steps"]),
    Case(
        "flag-no-value-then-flag", RL, ["--max-steps", "--dry-run"], ["--max-steps needs a value"]
    ),
    Case("flag-string-no-value", RL, ["--run.name", "--clean"], ["--run.name needs a value"]),
    Case(
        "flag-nested-no-value",
        RL,
        ["--orchestrator.batch-size", "--max-steps", "3"],
        ["--orchestrator.batch-size needs a value"],
    ),
    Case("int-not-a-number", RL, ["--orchestrator.batch-size", "abc"], ["batch-size", "'abc'"]),
    Case("int-is-float", RL, ["--max-steps", "2.5"], ["--max-steps", "'2.5'"]),
    Case("seq-len-too-small", RL, ["--seq-len", "4"], ["--seq-len", "greater than or equal to 8"]),
    Case("max-steps-zero", RL, ["--max-steps", "0"], ["--max-steps", "'0'"]),
    Case("dtype-unknown", RL, ["--model.dtype", "float64"], ["--model.dtype", "'float64'"]),
    Case("optim-type-unknown", RL, ["--trainer.optim.type", "adam"], ["--trainer.optim", "'adam'"]),
    Case("lr-negative", RL, ["--trainer.optim.lr", "-1"], ["--trainer.optim.lr", "'-1'"]),
    Case("lr-inf", RL, ["--trainer.optim.lr", "inf"], ["--trainer.optim.lr", "finite"]),
    Case("lr-nan", TRAINER, ["--optim.lr", "nan"], ["--optim.lr", "'nan'"]),
    Case("timeout-inf", RL, ["--bus.connect-timeout-s", "inf"], ["--bus.connect-timeout-s"]),
    Case("top-p-above-one", RL, ["--orchestrator.sampling.top-p", "1.5"], ["top-p", "'1.5'"]),
    Case(
        "temperature-negative", ORCH, ["--sampling.temperature", "-1"], ["--sampling.temperature"]
    ),
    Case("json-value-bad", RL, ["--orchestrator.sampling.extra-body", "{bad"], ["JSON value"]),
    Case("port-too-big", RL, ["--inference.server.port", "70000"], ["--inference.server.port"]),
    Case("port-negative", INFER, ["--backend-port", "-1"], ["--backend-port", "'-1'"]),
    Case("payload-too-big", RL, ["--bus.max-payload-mb", "100"], ["--bus.max-payload-mb", "'100'"]),
    Case(
        "bus-password-no-user",
        RL,
        ["--bus.password-file", "p"],
        ["bus.password_file needs bus.user"],
    ),
    Case("bus-key-no-cert", ORCH, ["--bus.tls-key", "k.pem"], ["bus.tls_key needs bus.tls_cert"]),
    Case(
        "bus-dedup-window",
        RL,
        ["--bus.duplicate-window-s", "100", "--bus.stream-max-age-s", "10"],
        ["bus.duplicate_window_s"],
    ),
    Case("log-level-unknown", RL, ["--log.level", "verbose"], ["--log.level", "'verbose'"]),
    Case("replicas-zero", RL, ["--deployment.num-infer-replicas", "0"], ["num-infer-replicas"]),
    Case(
        "cpu-binding-unknown", RL, ["--deployment.cpu-binding", "x"], ["--deployment.cpu-binding"]
    ),
    Case("ckpt-interval-zero", RL, ["--ckpt.interval", "0"], ["--ckpt.interval", "'0'"]),
    Case("resume-step-negative", RL, ["--resume.step", "-1"], ["--resume.step", "'-1'"]),
    Case(
        "gpu-util-above-one",
        RL,
        ["--inference.vllm.gpu-memory-utilization", "1.5"],
        ["gpu-memory-utilization", "'1.5'"],
    ),
    Case(
        "kv-bytes-not-a-size",
        INFER,
        ["--vllm.cpu-kv-cache-bytes", "lots"],
        ["--vllm.cpu-kv-cache-bytes", "'lots'"],
    ),
    Case("role-unknown", ORCH, ["--role", "boss"], ["--role", "'boss'"]),
    Case("env-list-empty", RL, ["--orchestrator.env", "[]"], ["--orchestrator.env", "at least 1"]),
    Case(
        "min-lr-ratio-above-one",
        RL,
        ["--trainer.scheduler.type", "cosine", "--trainer.scheduler.min-lr-ratio", "2"],
        ["--trainer.scheduler.min-lr-ratio", "'2'"],
    ),
    Case("custom-loss-no-path", TRAINER, ["--loss.type", "custom"], ["--loss.import-path"]),
    Case(
        "fake-rollouts-in-rl",
        RL,
        ["--trainer.data.fake"],
        ["--trainer.data.fake", "trainer @ FILE"],
    ),
    Case("fake-sft-endless", SFT, ["--data.type", "fake"], ["--max-steps", "fake data never ends"]),
    Case(
        "sft-name-and-path",
        SFT,
        ["--data.name", "org/set", "--data.path", "reverse-text"],
        ["--data.name", "not both"],
    ),
    Case(
        "sft-splits-per-subset",
        SFT,
        ["--data.name", "org/set", "--data.subsets", "a", "b", "--data.splits", "x", "y", "z"],
        ["--data.splits", "one split per subset"],
    ),
    Case("window-zero", RL, ["--supervision.window-s", "0"], ["--supervision.window-s", "'0'"]),
    Case(
        "http-backoff-order",
        ORCH,
        ["--http.backoff-max-s", "0.5"],
        ["http.backoff_max_s (0.5) must be >= http.backoff_s"],
    ),
    Case(
        "difficulty-thresholds-order",
        RL,
        ["--orchestrator.difficulty-filter.failed-threshold", "1"],
        ["--orchestrator.difficulty-filter.failed-threshold", "below solved_threshold (1.0)"],
    ),
    Case(
        "difficulty-env-threshold",
        RL,
        ["@", "c.toml"],
        [
            "--orchestrator.env[0].difficulty-filter.solved-threshold",
            "failed at reward <= 0.0 and solved at >= -1.0",
        ],
        {
            "c.toml": "[orchestrator.difficulty_filter]\nenabled = true\n"
            '[[orchestrator.env]]\nid = "reverse-text"\n'
            "difficulty_filter = { solved_threshold = -1.0 }\n"
        },
    ),
    Case(
        "difficulty-consecutive-zero",
        ORCH,
        ["--difficulty-filter.consecutive", "0"],
        ["--difficulty-filter.consecutive", "'0'"],
    ),
    Case("val-interval-zero", SFT, ["--data.val-interval", "0"], ["--data.val-interval", "'0'"]),
    Case("copy-fraction-one", SFT, ["--data.copy-fraction", "1"], ["--data.copy-fraction", "'1'"]),
    Case("lease-ttl-zero", INFER, ["--lease-ttl-s", "0"], ["--lease-ttl-s", "'0'"]),
    # --- cross-field rules (load time, a dry run included) ---
    Case(
        "betas-three",
        RL,
        ["--trainer.optim.betas", "0.9", "0.9", "0.9"],
        ["--trainer.optim.betas", "exactly two", "[0.9, 0.9, 0.9]"],
    ),
    Case("betas-one", TRAINER, ["--optim.betas", "0.9"], ["--optim.betas", "exactly two", "[0.9]"]),
    Case("betas-range", TRAINER, ["--optim.betas", "1.0", "0.9"], ["--optim.betas", "[0, 1)"]),
    Case(
        "betas-file",
        RL,
        ["@", "c.toml"],
        ["--trainer.optim.betas", "exactly two"],
        {"c.toml": "[trainer.optim]\nbetas = []\n"},
    ),
    Case(
        "sgd-momentum-one",
        RL,
        ["--trainer.optim.type", "sgd", "--trainer.optim.momentum", "1"],
        ["--trainer.optim.momentum", "'1'"],
    ),
    Case(
        "muon-momentum-above-one",
        TRAINER,
        ["--optim.type", "muon", "--optim.momentum", "1.5"],
        ["--optim.momentum", "'1.5'"],
    ),
    Case(
        "batch-not-multiple-of-group",
        RL,
        ["--orchestrator.batch-size", "10"],
        ["--orchestrator.batch-size", "multiple of group_size (8)", "got 10", "use 8 or 16"],
    ),
    Case(
        "batch-below-group",
        ORCH,
        ["--batch-size", "4", "--group-size", "8"],
        ["--batch-size", "multiple of group_size (8)", "got 4"],
    ),
    Case(
        "max-tokens-over-pushed-seq-len",
        RL,
        ["--seq-len", "64", "--orchestrator.sampling.max-tokens", "100"],
        ["--orchestrator.sampling.max-tokens", "max_model_len (64", "got 100"],
    ),
    Case(
        "max-tokens-over-max-model-len",
        RL,
        ["--inference.vllm.max-model-len", "100"],
        ["--orchestrator.sampling.max-tokens", "max_model_len (100", "got 128"],
    ),
    Case(
        "dr-grpo-with-normalized-advantages",
        RL,
        ["--trainer.loss.type", "dr_grpo", "--orchestrator.normalize-advantages"],
        ["--orchestrator.normalize-advantages", "trainer.loss.type = 'dr_grpo'", "must be false"],
    ),
    Case(
        "ref-offload-on-two-ranks",
        RL,
        [
            "--trainer.loss.ref-kl-coef",
            "0.1",
            "--trainer.reference.offload",
            "--deployment.num-train-gpus",
            "2",
        ],
        ["--trainer.reference.offload", "deployment.num_train_gpus = 1", "--trainer.lora"],
    ),
    Case(
        "loss-type-unknown",
        TRAINER,
        ["--loss.type", "ppo"],
        ["--loss", "'ppo'", "dr_grpo", "gspo", "dapo"],
    ),
    Case(
        "ref-kl-coef-negative",
        TRAINER,
        ["--loss.ref-kl-coef", "-1"],
        ["--loss.ref-kl-coef", "'-1'"],
    ),
    Case(
        "gspo-eps-low-one",
        TRAINER,
        ["--loss.type", "gspo", "--loss.eps-low", "1"],
        ["--loss.eps-low", "'1'"],
    ),
    Case(
        "dr-grpo-max-tokens-zero",
        RL,
        ["--trainer.loss.type", "dr_grpo", "--trainer.loss.max-tokens", "0"],
        ["--trainer.loss.max-tokens", "'0'"],
    ),
    Case(
        "inference-url-not-http",
        ORCH,
        ["--inference-urls", "host:8000/v1"],
        ["--inference-urls", "'host:8000/v1'", "http(s) URL"],
    ),
    Case(
        "engine-port-is-router-port",
        RL,
        ["--inference.backend-port", "8000"],
        ["--inference.backend-port", "server.port (8000)", "got 8000"],
    ),
    Case(
        "engine-port-is-router-port-inference",
        INFER,
        ["--server.port", "9100", "--backend-port", "9100"],
        ["--backend-port", "server.port (9100)"],
    ),
    Case(
        "replica-port-ranges-overlap",
        RL,
        [
            "--deployment.num-infer-replicas",
            "3",
            "--inference.server.port",
            "9000",
            "--inference.backend-port",
            "9002",
        ],
        ["--inference.backend-port", "9002..9004", "9000..9002", "at least 3 apart"],
    ),
    Case(
        "replica-base-port-zero",
        RL,
        ["--deployment.num-infer-replicas", "2", "--inference.server.port", "0"],
        ["--inference.server.port", "0 cannot be a base port for 2 replicas"],
    ),
    Case(
        "replica-ports-past-65535",
        RL,
        ["--deployment.num-infer-replicas", "4", "--inference.backend-port", "65534"],
        ["--inference.backend-port", "65537", "past 65535"],
    ),
    Case(
        "slurm-sidecar-ports-equal",
        RL,
        ["--slurm.nats-http-port", "4222"],
        ["--slurm.nats-http-port", "slurm.nats_port (4222)"],
    ),
    Case(
        "sft-batch-below-ranks",
        SFT,
        ["--num-processes", "4", "--data.batch-size", "2"],
        ["--data.batch-size", "num_processes (4)", "got 2"],
    ),
    Case(
        "full-offload-with-state-offload",
        TRAINER,
        ["--model.full-offload"],
        ["model.full_offload and model.optim_cpu_offload are mutually exclusive"],
    ),
    Case(
        "full-offload-with-muon",
        TRAINER,
        ["--model.full-offload", "--no-model.optim-cpu-offload", "--optim.type", "muon"],
        ["optim.type adamw or sign_sgd, not 'muon'"],
    ),
    Case(
        "copy-fraction-with-file-data",
        SFT,
        ["--data.copy-fraction", "0.4", "--data.path", "d.jsonl"],
        ["data.copy_fraction=0.4", "not 'd.jsonl'"],
        {"d.jsonl": "{}\n"},
    ),
    # --- paths that must exist (checked after parsing, before anything starts) ---
    Case(
        "model-dir-missing",
        RL,
        ["--model.name", "/no/such/model"],
        ["--model.name", "'/no/such/model'", "no such directory"],
    ),
    Case(
        "model-dir-relative-missing",
        RL,
        ["--model.name", "./models/x"],
        ["--model.name", "'./models/x'"],
    ),
    Case(
        "model-deep-relative-missing",
        RL,
        ["--model.name", "outputs/models/x"],
        ["--model.name", "'outputs/models/x'"],
    ),
    Case(
        "model-is-a-file",
        SFT,
        ["--model.name", "./m.bin"],
        ["--model.name", "is a file"],
        {"m.bin": "x"},
    ),
    Case(
        "model-dir-no-config",
        TRAINER,
        ["--model.name", "./m/"],
        ["--model.name", "has no config.json"],
        {"m/": ""},
    ),
    Case(
        "vllm-model-missing",
        INFER,
        ["--vllm.model", "/no/such/model"],
        ["--vllm.model", "'/no/such/model'"],
    ),
    Case(
        "rl-vllm-model-differs",
        RL,
        ["--model.name", str(TINY_MODEL), "--inference.vllm.model", "/no/such/model"],
        ["--inference.vllm.model", "'/no/such/model'"],
    ),
    Case(
        "trainer-model-home-missing",
        TRAINER,
        ["--model.name", "~/no/such/model"],
        ["--model.name", "'~/no/such/model'"],
    ),
    Case(
        "sft-data-missing",
        SFT,
        ["--data.path", "./no.jsonl"],
        ["--data.path", "'./no.jsonl'", "no such file"],
    ),
    Case(
        "sft-val-data-missing",
        SFT,
        ["--data.val-path", "/no/val.jsonl"],
        ["--data.val-path", "'/no/val.jsonl'"],
    ),
    Case(
        "dry-run-still-checks-explicit-paths",
        RL,
        ["--dry-run", "--model.name", "/no/such/model"],
        ["--model.name", "'/no/such/model'"],
        strict=False,
    ),
]

ACCEPTED = [
    # The rules above are not broader than they say.
    (RL, ["--orchestrator.batch-size", "16", "--orchestrator.group-size", "8"]),
    (
        RL,
        [
            "--orchestrator.difficulty-filter.enabled",
            "--orchestrator.difficulty-filter.failed-threshold",
            "0.5",
        ],
    ),
    (ORCH, ["--batch-size", "10", "--token-budget", "4096"]),  # a token budget sizes the step
    (INFER, ["--server.port", "0", "--backend-port", "0"]),  # 0: each picks a free port
    (
        RL,
        [
            "--deployment.num-infer-replicas",
            "2",
            "--inference.server.port",
            "9000",
            "--inference.backend-port",
            "9002",
        ],
    ),
    (RL, ["--model.name", "Org/Some-Model"]),  # a hub id is not a local path
    (RL, ["--model.name", str(TINY_MODEL)]),
    # The orchestrator only sends the name: the files live with inference (another container).
    (ORCH, ["--model.name", "/models/on-the-inference-host"]),
    (TRAINER, ["--optim.betas", "0.8", "0.95"]),
    (RL, ["--trainer.loss.type", "dr_grpo"]),  # std normalisation is off by default
    (RL, ["--trainer.loss.type", "gspo", "--orchestrator.normalize-advantages"]),
    (RL, ["--trainer.loss.ref-kl-coef", "0.1", "--deployment.num-train-gpus", "2"]),  # sharded
    (
        RL,
        [
            *("--trainer.loss.ref-kl-coef", "0.1", "--trainer.reference.offload"),
            *("--deployment.num-train-gpus", "2", "--trainer.lora"),  # LoRA: nothing to offload
        ],
    ),
    (RL, ["--trainer.loss.ref-kl-coef", "0.1", "--trainer.reference.offload"]),
    (RL, ["--seq-len", "128", "--orchestrator.sampling.max-tokens", "128"]),
    (ORCH, ["--seq-len", "64"]),  # standalone: samples are cut to seq_len, the engine is elsewhere
]


def make_files(root: Path, files: dict[str, str | bytes]) -> None:
    for name, content in files.items():
        path = root / name
        if name.endswith("/"):
            path.mkdir(parents=True)
        elif isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content)


def load(cls, args: list[str], strict: bool = True):
    """What an entry point does before it starts anything: parse, then check the paths."""
    config = parse_cli(cls, args)
    exit_if_paths_missing(config, strict=strict)
    return config


def flat(text: str) -> str:
    for char in "│╭╮╰╯─":
        text = text.replace(char, " ")
    return " ".join(text.split())


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("COLUMNS", "200")
    monkeypatch.delenv("RLBUS_DEBUG", raising=False)
    return tmp_path


def test_the_suite_covers_enough_bad_inputs():
    assert len(CONFIG_CASES) + len(COMMAND_CASES) >= 80
    assert len({c.id for c in CONFIG_CASES}) == len(CONFIG_CASES)


@pytest.mark.parametrize("case", CONFIG_CASES, ids=lambda c: c.id)
def test_a_bad_config_input_is_one_clear_error_with_exit_2(case, in_tmp, capsys):
    make_files(in_tmp, case.files)

    with pytest.raises(SystemExit) as exited:
        load(case.cls, case.args, strict=case.strict)

    err = capsys.readouterr().err
    assert exited.value.code == 2, err
    assert "Traceback" not in err
    for expected in case.expect:
        assert expected in flat(err), f"{expected!r} not in {flat(err)!r}"


@pytest.mark.parametrize("cls, args", ACCEPTED, ids=lambda v: getattr(v, "__name__", None))
def test_valid_neighbours_of_the_bad_inputs_still_load(cls, args, in_tmp):
    assert isinstance(load(cls, args), cls)


def test_a_dry_run_leaves_relative_paths_to_the_launch(in_tmp):
    """`outputs/models/x` may be built between `--dry-run` and the launch (docs/configuration.md)."""
    config = load(RL, ["--dry-run", "--model.name", "outputs/models/x"], strict=False)

    assert config.model.name == "outputs/models/x"


# --- the real commands ----------------------------------------------------------------------


@dataclass
class Command:
    """A real command that must fail fast: its argv, exit code and what stderr names."""

    id: str
    argv: list[str]
    code: int
    expect: list[str]
    files: dict[str, str | bytes] = field(default_factory=dict)


KEEP = "keep"
"""The existing run every command runs next to (`--output-dir outputs`): it must survive."""


def unreachable_bus() -> str:
    return f"nats://127.0.0.1:{free_port()}"


COMMAND_CASES = [
    Command(
        "trainer-fake-endless",
        ["trainer", "--data.fake", "--model.name", str(TINY_MODEL)],
        2,
        ["--max-steps", "fake data never ends"],
    ),
    Command(
        "rl-file-directory", ["rl", "--dry-run", "@", "c/"], 2, ["c", "is a directory"], {"c/": ""}
    ),
    Command(
        "rl-file-binary",
        ["rl", "--dry-run", "@", "b.toml"],
        2,
        ["is binary"],
        {"b.toml": b"\0\xff"},
    ),
    Command(
        "rl-json-list", ["rl", "--dry-run", "@", "l.json"], 2, ["not a table"], {"l.json": "[]"}
    ),
    Command("rl-yaml-empty", ["rl", "--dry-run", "@", "e.yaml"], 2, ["is empty"], {"e.yaml": ""}),
    Command(
        "rl-flag-no-value",
        ["rl", "--dry-run", "--max-steps", "--run.name", KEEP],
        2,
        ["--max-steps needs a value"],
    ),
    Command(
        "rl-flag-unknown",
        ["rl", "--dry-run", "--trainer.max-step", "3"],
        2,
        ["did you mean --trainer.max-steps?"],
    ),
    Command(
        "rl-env-id-unknown",
        ["rl", "--dry-run", "@", "c.toml"],
        2,
        ["--orchestrator.env[0].id", "'revers-text'", "did you mean 'reverse-text'"],
        {"c.toml": '[[orchestrator.env]]\nid = "revers-text"\n'},
    ),
    Command(
        "rl-betas",
        ["rl", "--dry-run", "--trainer.optim.betas", "0.9", "0.9", "0.9"],
        2,
        ["--trainer.optim.betas", "exactly two"],
    ),
    Command(
        "rl-port-clash",
        ["rl", "--dry-run", "--inference.backend-port", "8000"],
        2,
        ["--inference.backend-port", "8000"],
    ),
    Command(
        "rl-batch-group",
        ["rl", "--dry-run", "--orchestrator.batch-size", "12"],
        2,
        ["--orchestrator.batch-size", "got 12"],
    ),
    Command(
        "rl-launch-missing-model",
        ["rl", "--model.name", "./no-model", "--run.name", "fresh"],
        2,
        ["--model.name", "'./no-model'"],
    ),
    Command(
        "rl-output-dir-not-a-directory",
        ["rl", "--dry-run", "--output-dir", "afile/outputs"],
        4,
        [
            "NotADirectoryError",
            "afile",
            "check --model.name Qwen/Qwen3-0.6B, --output-dir afile/outputs",
        ],
        {"afile": "x"},
    ),
    Command(
        "rl-resume-no-run",
        ["rl", "--dry-run", "--resume", "--run.name", "none"],
        2,
        ["--resume", "none"],
    ),
    Command(
        "rl-resume-no-checkpoint",
        ["rl", "--dry-run", "--resume.step", "7", "--run.name", KEEP],
        2,
        ["--resume.step 7"],
    ),
    Command("rl-run-dir-has-artifacts", ["rl", "--dry-run", "--run.name", KEEP], 2, [KEEP]),
    Command(
        "sft-data-missing",
        ["sft", "--dry-run", "--data.path", "./no.jsonl"],
        2,
        ["--data.path", "'./no.jsonl'"],
    ),
    Command(
        "sft-batch-ranks",
        ["sft", "--dry-run", "--num-processes", "3", "--data.batch-size", "2"],
        2,
        ["--data.batch-size"],
    ),
    Command(
        "inference-port-clash",
        ["inference", "--server.port", "9300", "--backend-port", "9300"],
        2,
        ["--backend-port", "9300"],
    ),
    Command(
        "inference-model-missing",
        ["inference", "--vllm.model", "/no/such/model"],
        2,
        ["--vllm.model", "'/no/such/model'"],
    ),
    Command(
        "orchestrator-batch-group",
        ["orchestrator", "--batch-size", "6", "--group-size", "4"],
        2,
        ["--batch-size", "got 6"],
    ),
    Command("trainer-betas", ["trainer", "--optim.betas", "0.9"], 2, ["--optim.betas", "[0.9]"]),
    Command(
        "orchestrator-bus-unreachable",
        ["orchestrator", "--run.name", "orch", "--bus.url", "{bus}", "--bus.connect-retry-s", "1"],
        5,
        ["service_error", "BusConnectError", "bus.connect_retry_s=1.0s"],
    ),
]


def snapshot(root: Path) -> dict[str, str]:
    """Every path under `root` with a hash of its content (directories as `dir`)."""
    return {
        str(p.relative_to(root)): "dir"
        if p.is_dir()
        else hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
    }


@pytest.mark.parametrize("case", COMMAND_CASES, ids=lambda c: c.id)
def test_a_real_command_fails_in_one_line_and_keeps_the_existing_run(case, tmp_path):
    make_files(tmp_path, case.files)
    run_dir = tmp_path / "outputs" / KEEP
    (run_dir / "checkpoints" / "step_3").mkdir(parents=True)
    (run_dir / "checkpoints" / "step_3" / "weights.bin").write_bytes(b"precious")
    (run_dir / "metrics.jsonl").write_text('{"step": 3}\n')
    before = snapshot(tmp_path / "outputs")
    command, *args = [a.format(bus=unreachable_bus()) for a in case.argv]
    if "--output-dir" not in args:
        args += (
            ["--output-dir", "outputs"]
            if command in ("rl", "sft", "orchestrator", "trainer")
            else []
        )

    started = time.monotonic()
    result = run_command(command, *args, cwd=tmp_path, env={"RLBUS_DEBUG": ""})

    output = result.stdout + result.stderr
    assert result.returncode == case.code, output
    assert "Traceback" not in output
    for expected in case.expect:
        assert expected in error_text(result), f"{expected!r} not in {error_text(result)!r}"
    assert time.monotonic() - started < 30  # no hang: every wait has a deadline
    after = snapshot(tmp_path / "outputs")
    assert {k: v for k, v in after.items() if k in before} == before  # the run kept its data
    assert not (run_dir / "configs").exists()


def test_debug_keeps_the_traceback(tmp_path):
    (tmp_path / "afile").write_text("x")

    result = run_command("rl", "--dry-run", "--debug", "--output-dir", "afile/out", cwd=tmp_path)

    assert result.returncode == 1
    assert "Traceback" in result.stderr and "NotADirectoryError" in result.stderr


@pytest.mark.slow  # imports torch and transformers (~10 s here)
def test_a_model_directory_without_weights_ends_the_trainer_with_exit_4(nats_server, tmp_path):
    """It passes the load-time check (a directory with config.json); transformers' OSError once
    the trainer loads it is the run-time missing input."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_bytes((TINY_MODEL / "config.json").read_bytes())

    result = run_command(
        "trainer",
        "--run.name", "t",
        "--output-dir", "outputs",
        "--bus.url", nats_server.url,
        "--model.name", str(model),
        cwd=tmp_path,
        env={"HF_HUB_OFFLINE": "1", "RLBUS_DEBUG": ""},
    )  # fmt: skip

    assert result.returncode == 4, result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    assert "service_error" in result.stderr and "OSError" in result.stderr
    assert f"check --model.name {model}" in result.stderr


@pytest.mark.parametrize(
    "error, code",
    [
        (BusConnectError("no NATS server answered"), 5),
        (BusAuthError("refused the credentials"), 5),
        (FileNotFoundError(2, "No such file or directory", "m/config.json"), 4),
        (PermissionError(13, "Permission denied", "outputs"), 4),
        (RuntimeError("a bug"), 1),
    ],
)
def test_an_escaping_error_is_one_line_with_its_documented_code(error, code, capsys, monkeypatch):
    monkeypatch.delenv("RLBUS_DEBUG", raising=False)

    with pytest.raises(SystemExit) as exited, errors_in_one_line("demo", inputs="--model.name m"):
        raise error

    err = capsys.readouterr().err
    assert exited.value.code == code and err.count("\n") == 1 and err.startswith("demo: ")
    assert ("check --model.name m" in err) == (code == 4)


def test_sigterm_and_debug_pass_through_unchanged(monkeypatch):
    with pytest.raises(Terminated), errors_in_one_line("demo"):
        raise Terminated()
    monkeypatch.setenv("RLBUS_DEBUG", "1")
    with pytest.raises(RuntimeError), errors_in_one_line("demo"):
        raise RuntimeError("kept with its traceback")


@pytest.mark.parametrize("cls, flag", [(RL, "--model.name"), (INFER, "--vllm.model")])
def test_offline_a_hub_id_missing_from_the_cache_is_refused_at_launch(
    cls, flag, in_tmp, capsys, monkeypatch
):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    args = [flag, "no-such-org/no-such-model"]

    with pytest.raises(SystemExit) as exited:
        load(cls, args)

    assert exited.value.code == 2
    assert f"{flag}: not a local directory and not in the hub cache" in flat(
        capsys.readouterr().err
    )
    assert isinstance(load(cls, ["--dry-run", *args] if cls is RL else args, strict=False), cls)
