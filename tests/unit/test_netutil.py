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
