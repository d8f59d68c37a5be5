"""Small network helpers every side uses (no third-party imports)."""

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` that was free a moment ago (bind to port 0 and read it back).

    Another process may take it before the caller binds it; callers that must not race (vLLM's
    router-facing port, test fixtures) pick it immediately before starting the server.
    """
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` distinct free ports: all are held bound until the last is picked, so two calls in a
    row can never hand out the same port (an engine and its router, a NATS client and HTTP port)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind((host, 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def port_in_use(host: str, port: int) -> bool:
    """Whether a TCP server already listens on `host:port` (binding it fails). SO_REUSEADDR: a
    port held only by connections in TIME_WAIT (a server that just stopped) counts as free."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return True
    return False
