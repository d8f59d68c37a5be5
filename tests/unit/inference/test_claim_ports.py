"""`claim_ports`: a replica checks its ports before it starts anything or registers (real sockets
on loopback): 0 is a free port, a port held past the wait is one line naming the flag, a port
released during the wait is taken, and the two ports may not be equal (refused when the config
is loaded already; the start checks again)."""

import socket
import threading

import pytest
from pydantic import ValidationError

from rlbus.configs.inference import InferenceConfig
from rlbus.netutil import free_ports, port_in_use
from rlbus_inference import service
from rlbus_inference.service import PortInUse, claim_ports


def replica(port: int, backend_port: int) -> InferenceConfig:
    return InferenceConfig.model_validate(
        {"vllm": {"model": "m"}, "server": {"host": "127.0.0.1", "port": port},
         "backend_port": backend_port}
    )  # fmt: skip


def listen(port: int) -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", port))
    sock.listen()
    return sock


def test_port_zero_becomes_a_free_port_for_each():
    claimed = claim_ports(replica(0, 0))
    ports = (claimed.server.port, claimed.backend_port)
    assert 0 not in ports and ports[0] != ports[1]
    assert not any(port_in_use("127.0.0.1", port) for port in ports)


def test_a_port_held_past_the_wait_names_the_flag(monkeypatch):
    monkeypatch.setattr(service, "PORT_WAIT_S", 1.0)
    port, backend = free_ports(2)
    with listen(port), pytest.raises(PortInUse, match=f"--server.port {port} is in use"):
        claim_ports(replica(port, backend))
    with listen(backend), pytest.raises(PortInUse, match=f"--backend-port {backend} is in use"):
        claim_ports(replica(port, backend))


def test_a_port_released_during_the_wait_is_taken(monkeypatch):
    monkeypatch.setattr(service, "PORT_WAIT_S", 10.0)
    port, backend = free_ports(2)
    holder = listen(port)
    threading.Timer(1.5, holder.close).start()  # a dying replica's child letting go
    claimed = claim_ports(replica(port, backend))
    assert (claimed.server.port, claimed.backend_port) == (port, backend)


def test_equal_ports_are_refused_when_the_config_is_loaded_and_again_at_the_start():
    (port,) = free_ports(1)
    with pytest.raises(ValidationError, match="must differ from server.port"):
        replica(port, port)
    # The start checks again: two ports picked free (0) can race onto one.
    clashing = replica(port, 0).model_copy(update={"backend_port": port})
    with pytest.raises(PortInUse, match="--server.port and --backend-port are both"):
        claim_ports(clashing)


def test_the_public_port_is_held_from_the_start_so_no_one_takes_it_meanwhile():
    """Bound at once: another bind of the port fails until the replica lets go (with
    SO_REUSEADDR too, as uvicorn binds), and a port someone else holds is one line naming the
    flag."""
    (port,) = free_ports(1)
    config = replica(port, 0)
    held = service.bind_public_port(config)
    try:
        for reuse in (0, 1):
            other = socket.socket()
            other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, reuse)
            with pytest.raises(OSError):
                other.bind(("127.0.0.1", port))
            other.close()
        with pytest.raises(PortInUse, match=f"--server.port {port}: the public port could not"):
            service.bind_public_port(config)
    finally:
        held.close()
    service.bind_public_port(config).close()  # released: bindable again
