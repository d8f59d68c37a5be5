"""Rollout workers against real HTTP servers (a replica that answers 500 and one that answers a
completion, tiny http.server stand-ins for vLLM) and a real nats-server: the failing replica is
backed off (a bounded number of requests, one log line per back-off naming it), the task waits
and is completed by the good replica once it registers."""

import asyncio
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from rlbus.configs.orchestrator import InferenceHttpConfig
from rlbus.wire import rollouts as rollouts_wire
from rlbus.wire.replicas import ReplicaInfo
from rlbus.wire.tasks import SamplingArgs, Task
from rlbus_orchestrator.envs import ReverseTextEnv
from rlbus_orchestrator.worker import run_workers

CHOICE = {
    "message": {"role": "assistant", "content": "cba"},
    "finish_reason": "stop",
    "token_ids": [5, 6],
    "logprobs": {"content": [{"logprob": -0.5}, {"logprob": -0.5}]},
}


def completion(n: int) -> dict:
    """A completion with the `n` choices the request asked for."""
    return {"prompt_token_ids": [1, 2, 3], "choices": [CHOICE | {"index": i} for i in range(n)]}


class Replica:
    """A real HTTP server on a free port answering every POST with `status` (and a completion
    when 200); counts requests."""

    def __init__(self, port: int, status: int):
        self.requests = 0
        replica = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                replica.requests += 1
                request = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                answer = completion(request.get("n", 1)) if status == 200 else {"error": "boom"}
                body = json.dumps(answer).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.url = f"http://127.0.0.1:{port}/v1"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def replicas(free_ports):
    bad_port, good_port = free_ports(2)
    bad, good = Replica(bad_port, 500), Replica(good_port, 200)
    try:
        yield bad, good
    finally:
        bad.close()
        good.close()


async def register(bus, replica_id: str, url: str) -> None:
    info = ReplicaInfo(replica_id=replica_id, base_url=url, model="m")
    await bus.kv(bus.subjects.replicas_bucket).put(replica_id, info)


async def test_a_5xx_replica_is_backed_off_and_the_task_completes_on_a_good_one(
    bus, replicas, capsys
):
    bad, good = replicas
    await register(bus, "bad-replica", bad.url)
    stop = asyncio.Event()
    http = InferenceHttpConfig(backoff_s=0.2, backoff_max_s=1.0, no_replica_wait_s=60.0)
    workers = asyncio.create_task(
        run_workers(
            bus,
            num_workers=1,
            max_concurrency=4,
            group_size=2,
            model="m",
            static_urls=[],
            stop=stop,
            http_config=http,
        )
    )
    task = Task(
        task_id="train-0",
        step=1,
        env_id="reverse-text",
        problem=ReverseTextEnv().example("train", 0),
        sampling=SamplingArgs(max_tokens=4),
        group_size=2,
    )
    sub = await bus.js.pull_subscribe_bind(
        durable=bus.subjects.rollouts_durable, stream=bus.subjects.rollouts_stream
    )
    try:
        await bus.publish(bus.subjects.tasks, task, msg_id=task.task_id)
        started = time.monotonic()
        while time.monotonic() - started < 5.0:
            assert not workers.done(), workers
            await asyncio.sleep(0.2)
        # Without back-off a 500 costs a request every few ms per episode (thousands in 5 s);
        # with it: ~1 per back-off (0.2, 0.4, 0.8, 1, 1, ...) per episode in flight.
        assert 1 <= bad.requests <= 30, bad.requests
        assert good.requests == 0
        await register(bus, "good-replica", good.url)
        msgs = await sub.fetch(1, timeout=30)
        rollout = rollouts_wire.decoder.decode(msgs[0].data)
        assert rollout.task_id == "train-0" and rollout.error is None
        assert len(rollout.samples) == 2 and good.requests == 1  # one request for the group
    finally:
        stop.set()
        await asyncio.wait_for(workers, 30)
    out = capsys.readouterr().out
    backed_off = [line for line in out.splitlines() if "replica_backed_off" in line]
    assert backed_off and all("bad-replica" in line for line in backed_off)
    assert "HTTP 500" in backed_off[0]
    assert len(backed_off) <= 30
