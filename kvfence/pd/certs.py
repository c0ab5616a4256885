"""The cluster's certificates (I8): a private CA and one certificate per worker that names its
role, made with `cryptography`. `kvfence up` and the tests make them; across hosts an operator
makes them once with `kvfence certs` (or any CA) and hands each worker its own files.

The role is carried twice, on purpose: as the extended key usage (a prefill serves the bootstrap
port: serverAuth; a decode dials it: clientAuth), which OpenSSL itself enforces in the handshake,
and as a URI subject alternative name `urn:kvfence:role:<role>`, which kvfence checks after the
handshake (pd/tls.py) and which an operator can read in a certificate dump.
"""

from __future__ import annotations

import argparse
import datetime as dt
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

ROLES = ("prefill", "decode")
ROLE_URI = "urn:kvfence:role:"
DEFAULT_DAYS = 7  # short-lived: `kvfence up` makes fresh ones every start
_EKU = {"prefill": ExtendedKeyUsageOID.SERVER_AUTH, "decode": ExtendedKeyUsageOID.CLIENT_AUTH}


@dataclass(frozen=True)
class TlsFiles:
    """One worker's PEM files: its certificate, its private key, and the cluster CA."""

    cert: str
    key: str
    ca: str


@dataclass(frozen=True)
class _Ca:
    cert: x509.Certificate
    key: ec.EllipticCurvePrivateKey


def _write_private(path: Path, data: bytes) -> None:
    """0600 from the first byte: the key is never readable by others, not even briefly."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(path, 0o600)  # an existing file keeps its old mode through O_CREAT


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _cert_pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def _validity(days: float) -> tuple[dt.datetime, dt.datetime]:
    now = dt.datetime.now(dt.UTC)
    # A few minutes of back-dating absorb clock skew between hosts.
    return now - dt.timedelta(minutes=5), now + dt.timedelta(days=days)


def make_ca(out: Path, name: str = "kvfence cluster CA", days: float = DEFAULT_DAYS) -> Path:
    """A new cluster CA in out/ca.crt and out/ca.key (0600); the path of ca.crt."""
    out.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    start, end = _validity(days)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), False)
        .sign(key, hashes.SHA256())
    )
    _write_private(out / "ca.key", _key_pem(key))
    (out / "ca.crt").write_bytes(_cert_pem(cert))
    return out / "ca.crt"


def _load_ca(ca_dir: Path) -> _Ca:
    cert = x509.load_pem_x509_certificate((ca_dir / "ca.crt").read_bytes())
    key = serialization.load_pem_private_key((ca_dir / "ca.key").read_bytes(), password=None)
    assert isinstance(key, ec.EllipticCurvePrivateKey), "kvfence CAs use EC keys"
    return _Ca(cert, key)


def _san(role: str, hosts: tuple[str, ...]) -> x509.SubjectAlternativeName:
    names: list[x509.GeneralName] = [x509.UniformResourceIdentifier(ROLE_URI + role)]
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return x509.SubjectAlternativeName(names)


def issue(
    ca_dir: Path,
    role: str,
    out: Path,
    name: str | None = None,
    hosts: tuple[str, ...] = (),
    days: float = DEFAULT_DAYS,
) -> TlsFiles:
    """A certificate for one worker of `role`, signed by the CA in ca_dir: out/NAME.crt and
    out/NAME.key (0600), NAME defaulting to the role. hosts: addresses it is reached at
    (informational: peers check the CA and the role, not the address; see pd/tls.py)."""
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}: expected one of {ROLES}")
    ca = _load_ca(ca_dir)
    name = name or role
    out.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP256R1())
    start, end = _validity(days)
    cert = (
        x509.CertificateBuilder()
        .subject_name(
            x509.Name(
                [
                    x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, role),
                    x509.NameAttribute(NameOID.COMMON_NAME, f"kvfence {name}"),
                ]
            )
        )
        .issuer_name(ca.cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(min(end, ca.cert.not_valid_after_utc))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([_EKU[role]]), critical=True)
        .add_extension(_san(role, hosts), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca.key.public_key()), False
        )
        .sign(ca.key, hashes.SHA256())
    )
    _write_private(out / f"{name}.key", _key_pem(key))
    (out / f"{name}.crt").write_bytes(_cert_pem(cert))
    return TlsFiles(str(out / f"{name}.crt"), str(out / f"{name}.key"), str(ca_dir / "ca.crt"))


def self_signed(out: Path, role: str, name: str = "impostor") -> TlsFiles:
    """A certificate of `role` from a CA nobody trusts (tests: what an impostor can make)."""
    make_ca(out / "rogue-ca", name="not the cluster CA")
    return issue(out / "rogue-ca", role, out, name)


def cluster(out: Path, hosts: tuple[str, ...] = ("127.0.0.1",)) -> Path:
    """A CA and one certificate per role in out/ (the layout KVFENCE_TLS_DIR names)."""
    make_ca(out)
    for role in ROLES:
        issue(out, role, out, hosts=hosts)
    return out


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvfence certs",
        description="Make a kvfence cluster CA and PD workers' certificates (mutual TLS, I8).",
    )
    p.add_argument("--out", required=True, help="directory for the files")
    p.add_argument("--ca", action="store_true", help="make a new cluster CA in --out")
    p.add_argument("--ca-dir", help="directory of the CA that signs (default: --out)")
    p.add_argument("--role", choices=ROLES, help="make a worker certificate of this role")
    p.add_argument("--name", help="file name of the worker's certificate (default: the role)")
    p.add_argument("--host", action="append", default=[], help="an address of the worker")
    p.add_argument("--days", type=float, default=DEFAULT_DAYS, help="validity in days")
    return p


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    out = Path(args.out)
    if not args.ca and not args.role:
        print("kvfence certs: nothing to do: pass --ca and/or --role")
        return 2
    if args.ca:
        print(f"CA: {make_ca(out, days=args.days)} (keep ca.key off the workers)")
    if args.role:
        files = issue(
            Path(args.ca_dir or out), args.role, out, args.name, tuple(args.host), args.days
        )
        print(f"--tls-cert {files.cert} --tls-key {files.key} --tls-ca {files.ca}")
    return 0
