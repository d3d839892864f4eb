"""tests/ports.py: the suite's servers take ports below the kernel's ephemeral range, where a
restored multi-rank engine's ranks never listened (docs/operations.md, "Ports")."""

import socket

from tests.ports import LOW, ephemeral_start, free_port


def test_free_ports_are_below_the_ephemeral_range_and_bindable():
    start = ephemeral_start()
    assert start > LOW + 1000  # Debian's default range starts at 32768
    ports = [free_port() for _ in range(50)]
    assert all(LOW <= p < start for p in ports), ports
    assert len(set(ports)) > 40  # chosen at random, not one port again and again
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[-1]))


def test_a_port_in_use_is_never_handed_out():
    held = []
    try:
        for _ in range(20):
            s = socket.socket()
            s.bind(("127.0.0.1", free_port()))
            s.listen()
            held.append(s)
        taken = {s.getsockname()[1] for s in held}
        assert not taken & {free_port() for _ in range(200)}
    finally:
        for s in held:
            s.close()
