"""The weight-broadcast protocol (`rlbus.broadcast`) over gloo on loopback: rank 0 and rank 1 are
two threads of this process, each with its own group, exactly as trainer and worker use them."""

import json
import threading

import pytest
import torch

from rlbus import broadcast

CPU = torch.device("cpu")


def state_dict() -> dict[str, torch.Tensor]:
    """Every carried dtype, a scalar, and names out of alphabetical order (order is the sender's)."""
    torch.manual_seed(0)
    return {
        "z.weight": torch.randn(3, 4),
        "a.half": torch.randn(5).half(),
        "m.bf16": torch.randn(2, 2, 2).bfloat16(),
        "b.double": torch.randn(1, dtype=torch.float64),
        "ids": torch.arange(6, dtype=torch.int64).reshape(2, 3),
        "counts": torch.tensor([1, -2], dtype=torch.int32),
        "mask": torch.tensor([0, 255], dtype=torch.uint8),
        "scale": torch.tensor(2.5),
        "strided": torch.randn(4, 3).t(),  # not contiguous: the sender makes it so
    }


def receive_versions(port: int, out: list) -> None:
    """Rank 1: receive versions until the sender closes the group."""
    group = broadcast.open_group("127.0.0.1", port, 1, 2, 30, CPU)
    while (header := broadcast.receive_header(group)) is not None:
        out.append((header, list(broadcast.receive_tensors(group, header))))
    out.append(None)


def test_state_dicts_round_trip_in_order_then_close(free_ports):
    (port,) = free_ports(1)
    received: list = []
    receiver = threading.Thread(target=receive_versions, args=(port, received))
    receiver.start()
    sender = broadcast.open_group("127.0.0.1", port, 0, 2, 30, CPU)
    first, second = state_dict(), {"w": torch.ones(2)}
    sent = broadcast.send_state_dict(sender, 7, first)
    broadcast.send_state_dict(sender, 8, second)
    broadcast.send_close(sender)
    receiver.join(30)
    assert not receiver.is_alive()

    assert [r[0].version for r in received[:2]] == [7, 8]
    assert received[2] is None  # the close frame ends the receive loop
    header, tensors = received[0]
    assert header == sent
    assert [name for name, _ in tensors] == list(first)
    for name, tensor in tensors:
        assert tensor.dtype == first[name].dtype, name
        assert tensor.shape == first[name].shape, name
        assert torch.equal(tensor, first[name]), name
    assert torch.equal(received[1][1][0][1], second["w"])


def test_header_wire_layout_is_json_version_and_name_dtype_shape_triples():
    header = broadcast.Header.of(
        3, {"b": torch.zeros(2, 1), "a": torch.zeros((), dtype=torch.int32)}
    )
    assert json.loads(header.encode()) == {
        "version": 3,
        "tensors": [["b", "float32", [2, 1]], ["a", "int32", []]],
    }
    assert broadcast.Header.decode(header.encode()) == header


def test_an_uncarried_dtype_is_refused_before_any_frame_is_sent():
    class NoFrames:
        device = CPU

        def broadcast(self, tensor):
            raise AssertionError("a frame was sent")

    with pytest.raises(ValueError, match="'flags' has dtype bool"):
        broadcast.send_state_dict(NoFrames(), 1, {"w": torch.ones(1), "flags": torch.ones(1) > 0})
