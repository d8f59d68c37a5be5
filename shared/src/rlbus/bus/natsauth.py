"""Credentials, subject permissions and TLS material of a shared (compose, SLURM) NATS server.

One home for who may do what on a run's bus. `role_permissions(run_id, role)` derives each
service user's publish/subscribe allow lists from the subject contract (`RunSubjects`): a rollout
worker cannot publish weights, inference cannot publish batches or tasks, and nobody but `admin`
deletes or purges a stream. `write_security_dir(dir, run_id, hosts)` writes everything a server
and its clients need, once:

    <dir>/ca.pem            CA certificate (clients verify the server with it; not secret)
    <dir>/ca.key            CA private key (0600; re-issues the server certificate)
    <dir>/server.pem        server certificate for `hosts` (DNS names and IP addresses)
    <dir>/server.key        its private key (0600)
    <dir>/<role>.password   one random password per role (0600)
    <dir>/run_id            the run these permissions are for
    <dir>/auth.conf         `authorization` + `tls` blocks for a stock nats-server (0600;
                            `include` it, as deploy/nats.conf does)

`rlbus-nats --security-dir DIR` serves with it; services connect with `--bus.user ROLE
--bus.password-file DIR/ROLE.password --bus.tls-ca DIR/ca.pem` and a tls:// URL.
`share_role(dir, role, target)` (`--share ROLE=TARGET`) copies only `ca.pem` and that role's
password into a directory of its own, for a container that must not read the other passwords. TLS material is
made with the `cryptography` package (a declared dependency: no openssl binary needed, and the
same code on every host). Run `rlbus-nats-config --dir DIR --run-id RUN --host nats` to make one.
"""

import argparse
import datetime
import ipaddress
import json
import secrets
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from rlbus.secrets import read_secret_file, write_secret_file
from rlbus.wire.subjects import RunSubjects

if TYPE_CHECKING:  # cryptography is imported where a certificate is made (start-up time)
    from cryptography import x509
    from cryptography.hazmat.primitives.asymmetric.types import (
        CertificateIssuerPrivateKeyTypes,
        CertificateIssuerPublicKeyTypes,
        PrivateKeyTypes,
    )

ROLES = ("trainer", "orchestrator", "worker", "inference", "monitor", "admin")
"""One NATS user per role; `admin` (the sidecar's run-end watcher, operators) may do anything."""

CERT_DAYS = 365
"""Validity of the CA and the server certificate (docs/security.md, "Rotating tokens and
certificates")."""

# JetStream's own subjects every service needs: the API (stream/consumer/KV management, pull
# requests, direct gets), acknowledgements and flow-control replies of ordered consumers.
JETSTREAM_CLIENT = ["$JS.API.>", "$JS.ACK.>", "$JS.FC.>"]
# Destructive API calls no service makes; UPDATE too for the least trusted roles (a changed
# stream could source a subject they may publish into a bucket they may not write).
DESTRUCTIVE = ["$JS.API.STREAM.DELETE.>", "$JS.API.STREAM.PURGE.>", "$JS.API.STREAM.MSG.DELETE.>"]
UPDATE = ["$JS.API.STREAM.UPDATE.>"]


def kv_subject(bucket: str) -> str:
    """Subjects of every key of a KV bucket (what a put, create, update or delete publishes to)."""
    return f"$KV.{bucket}.>"


def role_publishes(s: RunSubjects, role: str) -> list[str]:
    """The run's data subjects `role` may publish to, besides events and dead letters."""
    return {
        "trainer": [kv_subject(s.weights_bucket), kv_subject(s.state_bucket), s.weights_published],
        # the coordinator, plus the rollout workers it runs in-process by default
        "orchestrator": [
            s.tasks,
            s.eval_tasks,
            s.rollouts,
            s.batches_all,
            kv_subject(s.state_bucket),
            s.evals("orchestrator"),
        ],
        "worker": [s.rollouts],
        "inference": [kv_subject(s.replicas_bucket), s.weights_applied, s.weights_failed],
        "monitor": [],
    }[role]


def role_permissions(run_id: str, role: str) -> dict:
    """nats-server `permissions` of `role` on run `run_id`."""
    assert role in ROLES, role
    if role == "admin":
        return {"publish": {"allow": [">"]}, "subscribe": {"allow": [">"]}}
    s = RunSubjects(run_id)
    common = [f"{s.prefix}.events.lifecycle.>", f"{s.prefix}.events.metrics.>", s.dead_all]
    deny = DESTRUCTIVE + (UPDATE if role in ("worker", "inference", "monitor") else [])
    return {
        "publish": {"allow": JETSTREAM_CLIENT + common + role_publishes(s, role), "deny": deny},
        # inboxes (request replies, consumer deliveries), live events, the step log, control
        "subscribe": {"allow": ["_INBOX.>", s.events_all, s.batches_all, f"{s.prefix}.control.>"]},
        # replies to the control requests it serves, without a publish right on inboxes
        "allow_responses": True,
    }


def nats_users(security_dir: Path) -> list[dict]:
    """The `authorization.users` of a server configured from `security_dir`."""
    run_id = (security_dir / "run_id").read_text().strip()
    return [
        {
            "user": role,
            "password": read_secret_file(
                security_dir / f"{role}.password", field=f"{role} password"
            ),
            "permissions": role_permissions(run_id, role),
        }
        for role in ROLES
    ]


# ---- TLS ---------------------------------------------------------------------------------------


def _key_pem(key: "PrivateKeyTypes") -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _load_key(path: Path) -> "CertificateIssuerPrivateKeyTypes":
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    data = read_secret_file(path, field="TLS key").encode()
    key = serialization.load_pem_private_key(data, password=None)
    assert isinstance(key, ec.EllipticCurvePrivateKey), f"{path}: not the EC key write_ca made"
    return key


def _builder(
    subject_cn: str, issuer_cn: str, public_key: "CertificateIssuerPublicKeyTypes", days: int
) -> "x509.CertificateBuilder":
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject_cn)]))
        .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer_cn)]))
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))  # clock skew between nodes
        .not_valid_after(now + datetime.timedelta(days=days))
    )


def write_ca(security_dir: Path, *, days: int = CERT_DAYS) -> None:
    """A new CA: `ca.pem` (readable) and `ca.key` (0600)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        _builder("rlbus NATS CA", "rlbus NATS CA", key.public_key(), days)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )  # fmt: skip
        .sign(key, hashes.SHA256())
    )
    write_secret_file(security_dir / "ca.key", _key_pem(key).decode().strip())
    (security_dir / "ca.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def _san(host: str) -> "x509.GeneralName":
    from cryptography import x509

    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def write_server_cert(security_dir: Path, hosts: list[str], *, days: int = CERT_DAYS) -> None:
    """(Re-)issue `server.pem` / `server.key` for `hosts`, signed by the CA in `security_dir`
    (the SLURM sidecar does this at job start, once it knows its node's address)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID

    ca_key = _load_key(security_dir / "ca.key")
    key = ec.generate_private_key(ec.SECP256R1())
    names = list(dict.fromkeys(hosts))
    cert = (
        _builder(names[0], "rlbus NATS CA", key.public_key(), days)
        .add_extension(x509.SubjectAlternativeName([_san(h) for h in names]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    write_secret_file(security_dir / "server.key", _key_pem(key).decode().strip())
    (security_dir / "server.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def write_security_dir(security_dir: Path, run_id: str, hosts: list[str]) -> Path:
    """CA, server certificate for `hosts` and one password per role, unless already there (a
    restarted stack or a requeued job keeps its credentials; delete the directory to rotate)."""
    security_dir.mkdir(parents=True, exist_ok=True)
    security_dir.chmod(0o700)
    if not (security_dir / "ca.key").exists():
        write_ca(security_dir)
    if not (security_dir / "server.pem").exists():
        write_server_cert(security_dir, hosts)
    for role in ROLES:
        if not (security_dir / f"{role}.password").exists():
            write_secret_file(security_dir / f"{role}.password", secrets.token_urlsafe(32))
    (security_dir / "run_id").write_text(run_id + "\n")
    write_secret_file(security_dir / "auth.conf", auth_conf_text(security_dir))
    return security_dir


def share_role(security_dir: Path, role: str, target: Path) -> Path:
    """Copy what a service of `role` needs, and nothing else, into `target`: `ca.pem` and its own
    `<role>.password` (0600). A container that mounts only its share cannot read another role's
    password, so a compromised rollout worker cannot log in as the trainer to publish weights."""
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}: one of {', '.join(ROLES)}")
    target.mkdir(parents=True, exist_ok=True)
    target.chmod(0o700)
    for stale in target.glob("*.password"):
        if stale.name != f"{role}.password":
            stale.unlink()
    password = read_secret_file(security_dir / f"{role}.password", field=f"{role} password")
    write_secret_file(target / f"{role}.password", password)
    (target / "ca.pem").write_bytes((security_dir / "ca.pem").read_bytes())
    return target


def auth_conf_text(security_dir: Path) -> str:
    """Top-level `authorization` and `tls` blocks (JSON values are nats-server config syntax)."""
    tls = {
        "cert_file": str((security_dir / "server.pem").absolute()),
        "key_file": str((security_dir / "server.key").absolute()),
        "timeout": 5,
    }
    users = {"users": nats_users(security_dir)}
    return f"authorization: {json.dumps(users, indent=2)}\ntls: {json.dumps(tls, indent=2)}"


def client_flags(security_dir: Path, role: str) -> list[str]:
    """Command-line flags that connect a service as `role` (paths only: no secret in argv)."""
    return [
        "--bus.user", role,
        "--bus.password-file", str(security_dir / f"{role}.password"),
        "--bus.tls-ca", str(security_dir / "ca.pem"),
    ]  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    """`rlbus-nats-config`: write a NATS security directory (users, permissions, TLS)."""
    parser = argparse.ArgumentParser(prog="rlbus-nats-config", description=main.__doc__)
    parser.add_argument("--dir", required=True, type=Path, help="the directory to write (0700)")
    parser.add_argument("--run-id", required=True, help="the run the permissions are for")
    parser.add_argument(
        "--host",
        action="append",
        default=[],
        help="a name or address clients reach the server at (repeat); localhost and 127.0.0.1 are added",
    )
    parser.add_argument(
        "--reissue-server-cert",
        action="store_true",
        help="issue a new server certificate even if one exists (new --host names, or rotation)",
    )
    parser.add_argument(
        "--share",
        action="append",
        default=[],
        metavar="ROLE=DIR",
        help="also copy ca.pem and ROLE's password (only) into DIR, for one service to mount (repeat)",
    )
    args = parser.parse_args(argv)
    hosts = [*args.host, "localhost", "127.0.0.1"]
    shares = []
    for share in args.share:
        role, sep, target = share.partition("=")
        if not sep or role not in ROLES or not target:
            parser.error(
                f"--share {share!r}: expected ROLE=DIR with ROLE one of {', '.join(ROLES)}"
            )
        shares.append((role, Path(target)))
    try:
        write_security_dir(args.dir, args.run_id, hosts)
        if args.reissue_server_cert:
            write_server_cert(args.dir, hosts)
    except (OSError, ValueError) as error:  # unwritable --dir, a CA key readable by others
        parser.error(f"--dir {args.dir}: {error}")
    for role, target in shares:
        try:
            share_role(args.dir, role, target)
        except (OSError, ValueError) as error:
            parser.error(f"--share {role}={target}: {error}")
    print(f"NATS security directory ready: {args.dir} (users: {', '.join(ROLES)})", file=sys.stderr)


if __name__ == "__main__":
    main()
