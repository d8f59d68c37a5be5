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


def test_header_wire_layout_is_json_version_bucket_size_and_name_dtype_shape_triples():
    header = broadcast.Header.of(
        3, {"b": torch.zeros(2, 1), "a": torch.zeros((), dtype=torch.int32)}, bucket_bytes=64
    )
    assert json.loads(header.encode()) == {
        "version": 3,
        "bucket_bytes": 64,
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


def spec(name: str, num_bytes: int) -> broadcast.TensorSpec:
    return broadcast.TensorSpec(name, "uint8", (num_bytes,))


def test_frames_pack_small_tensors_up_to_the_bucket_and_chunk_big_ones():
    sizes = {"a": 4, "b": 4, "empty": 0, "c": 3, "big": 25, "d": 2, "e": 10}
    header = broadcast.Header(1, tuple(spec(n, s) for n, s in sizes.items()), bucket_bytes=10)
    plan = broadcast.frames(header)
    assert [[(p.index, p.start, p.end) for p in frame] for frame in plan] == [
        [(0, 0, 4), (1, 0, 4), (2, 0, 0)],  # a + b + empty; c would make 11 bytes
        [(3, 0, 3)],
        [(4, 0, 10)],
        [(4, 10, 20)],
        [(4, 20, 25)],
        [(5, 0, 2)],  # d + e would make 12 bytes
        [(6, 0, 10)],
    ]
    # every byte of every tensor exactly once, in header order
    covered = [(p.index, b) for frame in plan for p in frame for b in range(p.start, p.end)]
    assert covered == [(i, b) for i, s in enumerate(sizes.values()) for b in range(s)]


class RecordingGroup:
    """A sender-side group that records each frame's size instead of sending it."""

    device = CPU
    world_size = 2
    where = "nowhere"

    def __init__(self, pulled: list) -> None:
        self.pulled = pulled
        self.frames: list[tuple[int, int]] = []  # (bytes, tensors pulled from the stream so far)

    def broadcast(self, tensor):
        self.frames.append((tensor.numel(), len(self.pulled)))

    def all_reduce(self, tensor):
        tensor += 1  # the one receiver acknowledges


def test_the_sender_pulls_each_tensor_only_when_its_frame_is_sent():
    state = {f"w{i}": torch.ones(i + 1, dtype=torch.uint8) for i in range(6)}  # 1..6 bytes
    pulled: list[str] = []

    def stream():
        for name, tensor in state.items():
            pulled.append(name)
            yield name, tensor

    group = RecordingGroup(pulled)
    header = broadcast.Header.of(1, state, bucket_bytes=7)
    broadcast.send_stream(group, header, stream())
    size_frame, header_frame, *data = group.frames
    # w0+w1+w2 (6 bytes), w3 (4: w4 would make 9), w4 (5), w5 (6): each sent once pulled,
    # before the next tensor is taken from the stream
    assert data == [(6, 3), (4, 4), (5, 5), (6, 6)]
    assert all(num_bytes <= 7 for num_bytes, _ in data)


def test_tensors_round_trip_in_small_buckets_and_chunks(free_ports):
    (port,) = free_ports(1)
    received: list = []
    receiver = threading.Thread(target=receive_versions, args=(port, received))
    receiver.start()
    sender = broadcast.open_group("127.0.0.1", port, 0, 2, 30, CPU)
    sent = {**state_dict(), "empty": torch.zeros(0, 3), "big": torch.randn(50)}
    broadcast.send_state_dict(sender, 9, sent, bucket_bytes=24)  # big: 200 bytes in 9 chunks
    broadcast.send_close(sender)
    receiver.join(30)
    assert not receiver.is_alive()
    header, tensors = received[0]
    assert header.bucket_bytes == 24
    assert [name for name, _ in tensors] == list(sent)
    for name, tensor in tensors:
        assert tensor.dtype == sent[name].dtype and tensor.shape == sent[name].shape, name
        assert torch.equal(tensor, sent[name]), name


def test_the_config_default_bucket_is_the_protocol_default():
    from rlbus.configs.common import WeightBroadcastConfig

    assert WeightBroadcastConfig().bucket_size == broadcast.BUCKET_BYTES
