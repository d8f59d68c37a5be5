"""An OTLP trace receiver for tests: OTLP/HTTP (protobuf or JSON body, `POST /v1/traces`) and
OTLP/gRPC (`TraceService/Export`) on free loopback ports, keeping every span it receives in
OTLP-JSON form (`rlbus.obs.tracing.spans_of_request`: each span with its `service`).

The real collector is not installable here (no container registry); this speaks the same
protocols from OpenTelemetry's own protobuf definitions, so what it accepts, a collector accepts.
"""

import json
import threading
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from rlbus.netutil import free_port
from rlbus.obs import tracing


class OtlpReceiver:
    def __init__(self) -> None:
        self.spans: list[dict] = []
        self.received: list[dict] = []
        """Every request as OTLP-JSON (what a collector's file exporter would write)."""
        self.requests = {"http": 0, "grpc": 0}
        self._lock = threading.Lock()
        self._http = None
        self._grpc = None
        self.http_port = self.grpc_port = 0

    @property
    def http_endpoint(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def grpc_endpoint(self) -> str:
        return f"http://127.0.0.1:{self.grpc_port}"

    def add(self, request: trace_service_pb2.ExportTraceServiceRequest, via: str) -> None:
        as_json = tracing.request_json(request)
        with self._lock:
            self.received.append(as_json)
            self.spans.extend(tracing.spans_of_request(as_json))
            self.requests[via] += 1

    def snapshot(self) -> list[dict]:
        with self._lock:
            return list(self.spans)

    def start(self) -> "OtlpReceiver":
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                request = trace_service_pb2.ExportTraceServiceRequest()
                if self.path != "/v1/traces":
                    self.send_response(404)
                    self.end_headers()
                    return
                if "json" in self.headers.get("Content-Type", ""):
                    from google.protobuf.json_format import Parse

                    Parse(body.decode(), request)  # hex ids would need the spec's rules: unused
                else:
                    request.ParseFromString(body)
                receiver.add(request, "http")
                answer = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args) -> None:
                pass

        self._http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.http_port = self._http.server_address[1]
        threading.Thread(target=self._http.serve_forever, daemon=True).start()

        class Service(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request, context):
                receiver.add(request, "grpc")
                return trace_service_pb2.ExportTraceServiceResponse()

        self._grpc = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), self._grpc)
        self.grpc_port = free_port()
        self._grpc.add_insecure_port(f"127.0.0.1:{self.grpc_port}")
        self._grpc.start()
        return self

    def stop(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
        if self._grpc is not None:
            self._grpc.stop(grace=None)

    def dump(self, path) -> None:
        """Write what was received as OTLP-JSON lines, as the collector's file exporter does
        (`rl-trace` reads it)."""
        with self._lock, open(path, "w") as out:
            for request in self.received:
                out.write(json.dumps(request, separators=(",", ":")) + "\n")
