"""I8's channel: TLS 1.3 with mutual certificates from the cluster CA, and the role check.

Every PD connection (bootstrap, control frames, tcp page bytes) is a TLS 1.3 session in which
both sides proved a key the cluster CA certified (CERT_REQUIRED on both ends), with fresh keys
per connection: a recorded or replayed handshake cannot complete, a frame from another session
does not decrypt, and nothing on the wire is readable. Each side then checks that the peer's
certificate names the role it must have (a decode dials only prefill certificates, a prefill
serves only decode certificates), so a stolen decode key cannot pose as a prefill.

Peers are identified by the CA and the role, not by host name: workers are addressed by IP and
move between hosts, and the CA is private to one cluster, so every certificate it issued with
the right role is an authorised peer (check_hostname stays off).
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass, field
from pathlib import Path

from kvfence import env
from kvfence.guards import Guards
from kvfence.pd.certs import ROLE_URI, TlsFiles

# The role each side must see in its peer's certificate.
PEER_ROLE = {"prefill": "decode", "decode": "prefill"}


class TlsConfigError(ValueError):
    """No usable certificate files; the message says how to provide them."""


class PeerRejected(ConnectionError):
    """The peer completed TLS but its certificate does not name the role it must have."""


def load_files(role: str, cert: str | None, key: str | None, ca: str | None) -> TlsFiles:
    """--tls-cert/--tls-key/--tls-ca, else KVFENCE_TLS_DIR's ca.crt, ROLE.crt and ROLE.key."""
    given = [x for x in (cert, key, ca) if x]
    if given and len(given) != 3:
        raise TlsConfigError("pass all three of --tls-cert, --tls-key and --tls-ca")
    if not given:
        d = env.tls_dir()
        if d is None:
            raise TlsConfigError(
                "PD workers talk over mutual TLS: pass --tls-cert, --tls-key and --tls-ca "
                f"(a certificate of this worker's role from the cluster CA) or set "
                f"{env.TLS_DIR} to a directory of ca.crt, {role}.crt and {role}.key "
                "(`kvfence up` makes them; `kvfence certs` for workers across hosts)"
            )
        cert, key, ca = (str(Path(d) / n) for n in (f"{role}.crt", f"{role}.key", "ca.crt"))
    files = TlsFiles(str(cert), str(key), str(ca))
    for path in (files.cert, files.key, files.ca):
        if not Path(path).is_file():
            raise TlsConfigError(f"TLS file {path} does not exist")
    return files


def _context(files: TlsFiles, server: bool, verify: bool) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server else ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.load_cert_chain(files.cert, files.key)
    ctx.check_hostname = False  # identity = cluster CA + role (module docstring)
    if verify:
        ctx.load_verify_locations(files.ca)
        ctx.verify_mode = ssl.CERT_REQUIRED
    else:
        ctx.verify_mode = ssl.CERT_NONE  # fault injection only: the peer_verify twin
    if server:
        ctx.options |= ssl.OP_NO_TICKET  # no resumption: every session proves its certificate
    return ctx


@dataclass
class TlsConfig:
    """One worker's TLS: its role, its files and the contexts built from them (built once; the
    unverified ones only when a test switches the peer_verify guard off)."""

    role: str
    files: TlsFiles
    _contexts: dict[tuple[bool, bool], ssl.SSLContext] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.role not in PEER_ROLE:
            raise ValueError(f"no TLS role {self.role!r}")
        try:
            self.context(server=self.role == "prefill", verify=True)
        except (ssl.SSLError, OSError) as e:
            raise TlsConfigError(f"cannot load the TLS files {self.files}: {e}") from e

    def context(self, server: bool, verify: bool) -> ssl.SSLContext:
        ctx = self._contexts.get((server, verify))
        if ctx is None:
            ctx = self._contexts[(server, verify)] = _context(self.files, server, verify)
        return ctx

    def check_peer(self, sock: ssl.SSLSocket | ssl.SSLObject, guards: Guards) -> None:
        """After the handshake: the peer's (verified) certificate must name the peer role."""
        if not guards.on("peer_verify"):
            return
        want = PEER_ROLE[self.role]
        got = peer_roles(sock)
        if want not in got:
            raise PeerRejected(f"peer certificate names role {sorted(got) or 'none'}, not {want}")


def peer_roles(sock: ssl.SSLSocket | ssl.SSLObject) -> set[str]:
    """The roles the peer's verified certificate names (empty when it was not verified)."""
    cert = sock.getpeercert()
    if not cert:
        return set()
    return {
        value[len(ROLE_URI) :]
        for kind, value in cert.get("subjectAltName", ())
        if kind == "URI" and value.startswith(ROLE_URI)
    }
