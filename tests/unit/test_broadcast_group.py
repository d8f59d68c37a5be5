"""The weight-broadcast group with real receiver processes over gloo (`rlbus.broadcast`): every
rank gets every version, and nothing hangs: a receiver that dies mid-version or never joins
fails the sender within the group timeout, with the rank named."""

import time

import pytest
import torch
from broadcast_support import join, results, spawn_receiver, stop

from rlbus import broadcast

CPU = torch.device("cpu")
TIMEOUT_S = 3


def make_state(version: int) -> dict[str, torch.Tensor]:
    return {"w": torch.full((4, 3), float(version)), "b": torch.arange(5.0) * version}


def expected_sums(version: int) -> dict[str, float]:
    return {name: float(t.double().sum()) for name, t in make_state(version).items()}


def test_member_ranks_are_assigned_in_replica_id_order_after_the_trainer():
    ranks, world_size = broadcast.member_ranks([("r-b", 2), ("r-a", 1), ("r-c", 1)])
    assert ranks == {"r-a": 1, "r-b": 2, "r-c": 4}
    assert world_size == 5
    assert broadcast.member_ranks([]) == ({}, 1)


@pytest.mark.parametrize("num_receivers", [2, 3])
def test_every_receiver_process_gets_every_version(num_receivers, free_ports, tmp_path):
    (port,) = free_ports(1)
    world_size = num_receivers + 1
    outs = [tmp_path / f"rank{r}.json" for r in range(1, world_size)]
    idle = [spawn_receiver() for _ in outs]
    receivers = [join(p, port, r, world_size, outs[r - 1]) for r, p in enumerate(idle, start=1)]
    try:
        group = broadcast.open_group("127.0.0.1", port, 0, world_size, TIMEOUT_S * 5, CPU)
        broadcast.send_state_dict(group, 1, make_state(1))
        broadcast.send_state_dict(group, 2, make_state(2))
        broadcast.send_close(group)
    finally:
        codes = stop(receivers)
    assert codes == [0] * num_receivers
    for out in outs:
        assert results(out) == [
            {"version": 1, "sums": expected_sums(1)},
            {"version": 2, "sums": expected_sums(2)},
            {"closed": True},
        ]


def test_a_receiver_dying_mid_version_fails_the_sender_in_time_naming_it(free_ports, tmp_path):
    (port,) = free_ports(1)
    alive, dying = spawn_receiver(), spawn_receiver()
    join(alive, port, 1, 3, tmp_path / "rank1.json", timeout_s=TIMEOUT_S)
    join(dying, port, 2, 3, tmp_path / "rank2.json", timeout_s=TIMEOUT_S, mode="die_after_header")
    try:
        group = broadcast.open_group("127.0.0.1", port, 0, 3, TIMEOUT_S, CPU)
        started = time.monotonic()
        big = {"w": torch.ones(1 << 20)}  # 4 MiB: more than the socket buffers hold
        with pytest.raises(broadcast.BroadcastError) as caught:
            broadcast.send_state_dict(group, 5, big, names={1: "replica a", 2: "replica b"})
        elapsed = time.monotonic() - started
    finally:
        codes = stop([alive, dying])
    message = str(caught.value)
    assert "weights version 5" in message
    assert "silent rank(s): 2 (replica b))" in message  # rank 1 failed too, but lives
    assert "keep serving their previous version" in message
    assert elapsed < TIMEOUT_S * 2 + 3
    assert codes[1] == 3
    assert group.closed
    assert "error" in results(tmp_path / "rank1.json")[-1]  # the survivor failed too, in time


def test_a_receiver_that_never_joins_fails_the_rendezvous_naming_its_rank(free_ports, tmp_path):
    (port,) = free_ports(1)
    joined = join(spawn_receiver(), port, 1, 3, tmp_path / "rank1.json", timeout_s=TIMEOUT_S)
    try:
        started = time.monotonic()
        with pytest.raises(broadcast.BroadcastError, match=r"rank\(s\) \[2\] of 3 did not join"):
            broadcast.open_group("127.0.0.1", port, 0, 3, TIMEOUT_S, CPU)
        elapsed = time.monotonic() - started
    finally:
        stop([joined])
    assert TIMEOUT_S - 0.5 < elapsed < TIMEOUT_S + 3


def test_a_dead_sender_fails_the_receivers_in_time(free_ports, tmp_path):
    (port,) = free_ports(1)
    receiver = join(spawn_receiver(), port, 1, 2, tmp_path / "rank1.json", timeout_s=TIMEOUT_S)
    group = broadcast.open_group("127.0.0.1", port, 0, 2, TIMEOUT_S, CPU)
    group.close()  # the trainer gone without a close frame
    started = time.monotonic()
    (code,) = stop([receiver], timeout_s=TIMEOUT_S * 3)
    assert code == 0 and time.monotonic() - started < TIMEOUT_S * 3
    assert "error" in results(tmp_path / "rank1.json")[-1]


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 3, reason="NCCL needs a GPU per rank (3)")
def test_every_nccl_receiver_gets_every_version(free_ports, tmp_path):
    (port,) = free_ports(1)
    outs = [tmp_path / f"rank{r}.json" for r in (1, 2)]
    idle = [spawn_receiver() for _ in outs]
    receivers = [
        join(p, port, r, 3, outs[r - 1], timeout_s=60, device=f"cuda:{r}")
        for r, p in enumerate(idle, start=1)
    ]
    try:
        group = broadcast.open_group("127.0.0.1", port, 0, 3, 60, torch.device("cuda:0"))
        broadcast.send_state_dict(group, 1, make_state(1))
        broadcast.send_close(group)
    finally:
        stop(receivers, timeout_s=60)
    for out in outs:
        assert results(out) == [{"version": 1, "sums": expected_sums(1)}, {"closed": True}]
