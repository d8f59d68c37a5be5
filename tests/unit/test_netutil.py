import socket

from rlbus.netutil import free_port, free_ports


def test_free_ports_are_distinct_and_bindable():
    ports = free_ports(8)
    assert len(set(ports)) == 8
    for port in ports:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_free_port_on_all_interfaces_is_bindable():
    port = free_port("")
    with socket.socket() as sock:
        sock.bind(("", port))


def test_a_port_handed_out_once_is_never_handed_out_again():
    """The launcher plans every service's ports long before they bind them: a later pick (its own
    /metrics server) must not get one of them back (a chaos run lost its replica that way)."""
    planned = set(free_ports(40))
    later = {free_port() for _ in range(200)}
    assert len(later) == 200 and not planned & later
