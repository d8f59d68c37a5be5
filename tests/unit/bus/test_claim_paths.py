"""A claim check arrives from the bus: its path is confined to the run's claims directory, its
file must be a regular file of the recorded size, and consumed files are deleted."""

import os

import pytest

from rlbus.bus import claimcheck
from rlbus.bus.errors import ClaimCheckError
from rlbus.wire.claims import ClaimCheck

PAYLOAD = b"rollout" * 500


@pytest.fixture
def stored(tmp_path):
    return claimcheck.store(tmp_path, "rlbus.r.rollouts", PAYLOAD, "m-1")


def forged(claim: ClaimCheck, path: str) -> ClaimCheck:
    return ClaimCheck(path=path, size=claim.size, sha256=claim.sha256)


@pytest.mark.parametrize(
    ("path", "why"),
    [
        ("/etc/passwd", "must be relative"),
        ("rollouts/x.bin", "must be relative and under claims/"),
        ("", "must be relative"),
        ("claims/../configs/rl.toml", r"'\.\.' is not allowed"),
        ("claims/rlbus.r.rollouts/../../../../etc/shadow", r"'\.\.' is not allowed"),
        ("claims/a\x00b", r"'\.\.' is not allowed"),
    ],
)
def test_paths_outside_the_claims_directory_are_refused(tmp_path, stored, path, why):
    with pytest.raises(ClaimCheckError, match=why):
        claimcheck.load(tmp_path, forged(stored, path))


def test_a_symlink_out_of_the_store_is_refused(tmp_path, stored):
    outside = tmp_path.parent / f"{tmp_path.name}-secret"
    outside.write_bytes(PAYLOAD)
    (tmp_path / "claims" / "link").symlink_to(outside)
    with pytest.raises(ClaimCheckError, match="outside"):
        claimcheck.load(tmp_path, forged(stored, "claims/link"))
    (tmp_path / "claims" / "dir").symlink_to(tmp_path.parent, target_is_directory=True)
    with pytest.raises(ClaimCheckError, match="outside"):
        claimcheck.load(tmp_path, forged(stored, f"claims/dir/{outside.name}"))


def test_a_fifo_is_refused_without_blocking(tmp_path, stored):
    fifo = tmp_path / "claims" / "rlbus.r.rollouts" / "pipe.bin"
    os.mkfifo(fifo)
    with pytest.raises(ClaimCheckError, match="not a regular file"):
        claimcheck.load(tmp_path, forged(stored, "claims/rlbus.r.rollouts/pipe.bin"))


def test_a_directory_or_a_file_of_another_size_is_refused(tmp_path, stored):
    with pytest.raises(ClaimCheckError, match="not a regular file"):
        claimcheck.load(tmp_path, forged(stored, "claims/rlbus.r.rollouts"))
    lying = ClaimCheck(path=stored.path, size=10, sha256=stored.sha256)
    with pytest.raises(ClaimCheckError, match=f"has {len(PAYLOAD)} bytes, expected 10"):
        claimcheck.load(tmp_path, lying)


def test_no_storage_dir_is_refused(stored):
    with pytest.raises(ClaimCheckError, match="storage_dir"):
        claimcheck.load(None, stored)


def test_equal_payloads_of_two_messages_get_a_file_each_and_retries_share_one(tmp_path, stored):
    again = claimcheck.store(tmp_path, "rlbus.r.rollouts", PAYLOAD, "m-1")
    other = claimcheck.store(tmp_path, "rlbus.r.rollouts", PAYLOAD, "m-2")
    assert again.path == stored.path and other.path != stored.path
    claimcheck.discard(tmp_path, stored)
    assert claimcheck.load(tmp_path, other) == PAYLOAD
    claimcheck.discard(tmp_path, other)
    assert not (tmp_path / "claims" / "rlbus.r.rollouts").exists()


def test_discard_never_deletes_outside_the_store(tmp_path, stored):
    victim = tmp_path.parent / f"{tmp_path.name}-victim"
    victim.write_text("keep me")
    claimcheck.discard(tmp_path, forged(stored, str(victim)))
    claimcheck.discard(tmp_path, forged(stored, f"claims/../../{victim.name}"))
    assert victim.read_text() == "keep me"


def test_discard_subjects_removes_only_the_doomed_subjects(tmp_path):
    for step in (1, 2, 3):
        claimcheck.store(tmp_path, f"rlbus.r.batches.{step}", PAYLOAD, f"batch-{step}")
    removed = claimcheck.discard_subjects(tmp_path, lambda s: s.endswith((".1", ".2")))
    assert removed == ["rlbus.r.batches.1", "rlbus.r.batches.2"]
    assert [p.name for p in (tmp_path / "claims").iterdir()] == ["rlbus.r.batches.3"]
