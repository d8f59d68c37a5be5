"""Run by a verifiers 0.4 environment's own venv interpreter, never imported by rlbus.

verifiers 0.4 pins openai>=2.54, which conflicts with rlbus's pins, so a `verifiers.v1`
environment lives in its own venv and rlbus starts this file with that venv's python
(`rlbus_orchestrator.envs.vf_server`). It imports only verifiers and the standard library:

    python vf_server_main.py tasks '<env config JSON>' > tasks.jsonl   # one task_data per line
    python vf_server_main.py serve '<env config JSON>' tcp://127.0.0.1:0 [MAX_CONCURRENT]

`tasks` prints the taskset's rows (each task's dumped `TaskData`, what a `run` request ships);
`serve` binds verifiers' `EnvServer` (at most MAX_CONCURRENT episodes at once; 0 or absent: no
bound), prints `address <endpoint>` once it listens, and exits when its parent (the rollout
worker) is gone.

The server's `train` model client reads vLLM's `/inference/v1/generate` answers through
`renderers`, which wants each logprob entry named `token_id:<id>`; vLLM gives `token_id` only.
`serve` adapts those answers here, on the verifiers side (`accept_vllm_logprob_entries`), so the
replica serves vLLM's answer unchanged.
"""

import json
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # verifiers lives in the env venv only
    from verifiers.v1.configs.env import EnvConfig


ROLE_DEFAULTS = {"harness": {"id": "null"}, "runtime": {"type": "subprocess"}}
"""What each agent role of the env gets unless the config sets it: one chat program with no
tools (the `null` harness) in a local subprocess, instead of verifiers' defaults (the taskset's
harness, Prime's cloud sandbox)."""


def env_config(raw: str) -> "EnvConfig":
    """The env config, every agent role of its env class (`agent` of the single-agent env,
    `assistant` and `user` of `user-sim`, ...) given ROLE_DEFAULTS where it sets nothing."""
    from verifiers.v1.configs.agent import AgentConfig
    from verifiers.v1.utils.loaders import env_config_type, resolve_env_config

    data = json.loads(raw)
    taskset_id = (data.get("taskset") or {}).get("id", "")
    cls = env_config_type(taskset_id, data.get("id") or "")
    for name, field in cls.model_fields.items():
        if isinstance(field.default, AgentConfig):
            role = data.setdefault(name, {})
            for key, default in ROLE_DEFAULTS.items():
                if getattr(field.default, key, None) is None or key == "runtime":
                    role.setdefault(key, default)
    return resolve_env_config(data)


def print_tasks(raw: str) -> None:
    from verifiers.v1.utils.loaders import load_taskset

    for task in load_taskset(env_config(raw).taskset):
        print(json.dumps(task.data.model_dump(mode="json", serialize_as_any=True)))


def stop_on_sigterm() -> None:
    """SIGTERM ends the server the way Ctrl-C does: asyncio cancels the episodes in flight, and
    verifiers' runtime kills each episode's program group (each runs in its own session, so
    nothing else would)."""
    import signal

    signal.signal(signal.SIGTERM, signal.default_int_handler)


def exit_with_parent() -> None:
    """End this server when the rollout worker that started it is gone, even killed with -9
    (the process is then re-parented, so its parent pid changes): SIGTERM to itself, then a
    hard exit if the clean stop takes over 10 s."""
    import os
    import signal
    import threading
    import time

    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(10.0)
        os._exit(0)

    threading.Thread(target=watch, daemon=True).start()


def name_logprob_tokens(payload: dict[str, Any]) -> dict[str, Any]:
    """`payload` (a generate answer) with each logprob entry that has only vLLM's `token_id`
    also named `"token": "token_id:<id>"`, the form `renderers` checks; entries that have a
    `token` already are left as they are."""
    for choice in payload.get("choices") or []:
        logprobs = choice.get("logprobs") if isinstance(choice, dict) else None
        entries = logprobs.get("content") if isinstance(logprobs, dict) else None
        for entry in entries or []:
            if isinstance(entry, dict) and "token" not in entry and "token_id" in entry:
                entry["token"] = f"token_id:{entry['token_id']}"
    return payload


def accept_vllm_logprob_entries() -> None:
    """Let verifiers' `train` client read vLLM's generate answers as vLLM writes them.

    renderers 0.1.12 (the newest; verifiers 0.4's pin) checks
    `choice.logprobs.content[i].token == "token_id:<id>"`, the naming vLLM's
    `--return-tokens-as-token-ids` gives in the OpenAI API, but vLLM 0.32's token API answers
    `{"token_id": <id>, "logprob": ...}` whatever that flag says, so every turn failed with
    `...content[0].token must be 'token_id:122'`. `renderers.client.generate` decodes the
    answer with the module's `parse_generate_response`, looked up at call time, so wrapping
    it there names the entries before the check. Remove once renderers reads `token_id`."""
    import renderers.client

    parse = renderers.client.parse_generate_response

    def parse_naming_tokens(raw: bytes) -> dict[str, Any]:
        return name_logprob_tokens(parse(raw))

    renderers.client.parse_generate_response = parse_naming_tokens


def serve(raw: str, address: str, max_concurrent: str = "0") -> None:
    import asyncio

    from verifiers.v1.serve import EnvServer

    stop_on_sigterm()
    exit_with_parent()
    accept_vllm_logprob_entries()
    bound = int(max_concurrent) or None
    server = EnvServer(config=env_config(raw), address=address, max_concurrent=bound)
    print(f"address {server.address}", flush=True)
    try:
        asyncio.run(server.run())
    except KeyboardInterrupt:
        pass


def main(argv: list[str]) -> None:
    command, *args = argv
    if command == "tasks":
        print_tasks(*args)
    elif command == "serve":
        serve(*args)
    else:
        raise SystemExit(f"unknown command {command!r}: tasks or serve")


if __name__ == "__main__":
    main(sys.argv[1:])
