"""The attach process watches the server it registered: while /health answers it stays, and it
ends (ChildExited naming the URL) after `health.failures` failed probes once the server is gone.
The server here is a real HTTP listener on a free port that answers /health."""

import asyncio
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from rlbus.configs.inference import InferenceConfig
from rlbus.lifecycle import ServiceState, TaskSupervisor
from rlbus.netutil import free_port
from rlbus_inference import engine_process
from rlbus_inference.service import watch_attached


class Health(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass


async def test_the_watch_ends_after_the_attached_server_stops_answering():
    port = free_port()
    server = ThreadingHTTPServer(("127.0.0.1", port), Health)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    config = InferenceConfig(
        attach={"url": f"http://127.0.0.1:{port}"},
        health={"interval_s": 0.1, "timeout_s": 0.5, "failures": 2},
    )
    state = ServiceState("inference")
    async with TaskSupervisor() as tasks:
        watch = asyncio.create_task(watch_attached(config, state, tasks))
        try:
            await asyncio.sleep(0.5)
            assert not watch.done()  # healthy: still watching
            server.shutdown()
            server.server_close()
            with pytest.raises(
                engine_process.ChildExited, match=f"127.0.0.1:{port} failed 2 health"
            ):
                await asyncio.wait_for(watch, 5)
        finally:
            watch.cancel()
            server.server_close()
