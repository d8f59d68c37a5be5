"""Small network helpers every side uses (no third-party imports)."""

import socket
from urllib.parse import urlsplit

CLIENT_KEEPALIVE_S = 2.0
"""How long our HTTP clients keep an idle connection for reuse. vLLM's server (uvicorn) closes an
idle keep-alive connection after 5 s (`VLLM_HTTP_TIMEOUT_KEEP_ALIVE`); a client that keeps it
longer (aiohttp's default is 15 s, httpx's 5 s) sometimes sends a request on a connection the
server is closing, and gets a disconnect, not an answer. Shorter than the server: the client
always closes first."""

SERVER_KEEPALIVE_S = 75.0
"""How long our HTTP servers (the replica's public gate) keep an idle connection open: longer
than any client's reuse (CLIENT_KEEPALIVE_S, httpx's 5 s, the usual 60 s of proxies), so that a
client never reuses a connection the server is closing."""

_handed_out: set[int] = set()
"""Ports this process already handed out. A planned port is not bound until its service starts
(seconds later): without this, a later pick (the launcher's own /metrics) could get it again."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` that was free a moment ago (bind to port 0 and read it back), and
    that this process has not handed out before.

    Another process may take it before the caller binds it; callers that must not race (vLLM's
    gate-facing port, test fixtures) pick it immediately before starting the server.
    """
    return free_ports(1, host)[0]


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` distinct free ports, none handed out by this process before: all are held bound
    until the last is picked, so two calls can never hand out the same port (an engine and its
    gate, a NATS client and HTTP port, a service's port and the launcher's /metrics)."""
    sockets: list[socket.socket] = []
    ports: list[int] = []
    try:
        while len(ports) < count:
            sock = socket.socket()
            sockets.append(sock)
            sock.bind((host, 0))
            port = sock.getsockname()[1]
            if port not in _handed_out:
                ports.append(port)
        _handed_out.update(ports)
        return ports
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


def is_wildcard(host: str) -> bool:
    """Whether `host` is a bind-to-every-interface address."""
    return host in ("0.0.0.0", "::", "")


def reachable_host() -> str:
    """A name or address of this machine that other hosts can reach.

    The host name when it resolves to a non-loopback address; else the address of the interface
    that routes outward (a UDP `connect` sends nothing); else the host name. `socket.getfqdn()`
    is not it: on hosts whose /etc/hosts maps the name to 127.0.0.1 it says `localhost`.
    """
    name = socket.gethostname()
    try:
        if not socket.gethostbyname(name).startswith("127."):
            return name
    except OSError:
        pass
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect(("192.0.2.1", 9))  # TEST-NET-1: any routable address will do
            address = probe.getsockname()[0]
        if not address.startswith(("127.", "0.")):
            return address
    except OSError:
        pass
    return name


def loopback_if_wildcard(host: str) -> str:
    """The address a client on this machine connects to for a server bound to `host`."""
    return "127.0.0.1" if is_wildcard(host) else host


def hostname_if_wildcard(host: str) -> str:
    """The name other machines use for a server bound to `host` (this machine's name when it is
    bound to every interface). Unlike `reachable_host`, no lookup: the name as the OS gives it."""
    return socket.gethostname() if is_wildcard(host) else host


def check_http_url(value: str, example: str = "http://127.0.0.1:8000") -> str:
    """`value` without a trailing slash, if it is an http(s) URL with a host; else ValueError
    naming `example`."""
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{value!r} is not an http(s) URL: give e.g. {example}")
    return value.rstrip("/")
