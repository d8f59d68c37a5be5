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
"""

import json
import sys


def env_config(raw: str):
    from verifiers.v1.utils.loaders import resolve_env_config

    return resolve_env_config(json.loads(raw))


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


def serve(raw: str, address: str, max_concurrent: str = "0") -> None:
    import asyncio

    from verifiers.v1.serve import EnvServer

    stop_on_sigterm()
    exit_with_parent()
    bound = int(max_concurrent) or None
    server = EnvServer(config=env_config(raw), address=address, max_concurrent=bound)
    print(f"address {server.address}", flush=True)
    try:
        asyncio.run(server.run())
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    command, *args = sys.argv[1:]
    {"tasks": print_tasks, "serve": serve}[command](*args)
