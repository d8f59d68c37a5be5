"""Secrets come from an owner-only file or an environment variable, and a bad file is one line."""

import os

import pytest

from rlbus.secrets import SecretError, read_secret_file, resolve_secret, write_secret_file


def test_write_secret_file_is_owner_only_and_reads_back(tmp_path):
    path = write_secret_file(tmp_path / "sub" / "token", "s3cret")
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert read_secret_file(path, field="bus.token_file") == "s3cret"


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o660, 0o644])
def test_a_file_others_can_read_is_refused_with_the_chmod_fix(tmp_path, mode):
    path = tmp_path / "token"
    path.write_text("s3cret\n")
    path.chmod(mode)
    with pytest.raises(SecretError, match=rf"bus.token_file: .*chmod 600 {path}"):
        read_secret_file(path, field="bus.token_file")


@pytest.mark.parametrize(
    ("make", "why"),
    [
        (lambda p: None, "does not exist"),
        (lambda p: p.mkdir(mode=0o700), "not a regular file"),
        (lambda p: (p.write_text("  \n"), p.chmod(0o600)), "is empty"),
        (lambda p: (p.write_bytes(b"\xff\xfe"), p.chmod(0o600)), "cannot read"),
    ],
)
def test_missing_directory_empty_or_binary_secret_files_name_the_field(tmp_path, make, why):
    path = tmp_path / "token"
    make(path)
    with pytest.raises(SecretError, match=f"^admin.token_file: .*{why}"):
        read_secret_file(path, field="admin.token_file")


def test_the_file_wins_over_the_environment_and_unset_is_none(tmp_path, monkeypatch):
    monkeypatch.setenv("RLBUS_TEST_SECRET", "from-env")
    path = write_secret_file(tmp_path / "token", "from-file")
    assert resolve_secret(field="x", file=path, env="RLBUS_TEST_SECRET") == "from-file"
    assert resolve_secret(field="x", file=None, env="RLBUS_TEST_SECRET") == "from-env"
    monkeypatch.delenv("RLBUS_TEST_SECRET")
    assert resolve_secret(field="x", file=None, env="RLBUS_TEST_SECRET") is None
