"""The tests' cluster certificates (I8): one CA and one certificate per role, made once per test
process in a temporary directory (the layout KVFENCE_TLS_DIR names, so worker processes the
tests start find them too), plus impostors' certificates from a CA nobody trusts."""

from __future__ import annotations

import atexit
import shutil
import tempfile
from functools import cache
from pathlib import Path

from kvfence.pd import certs
from kvfence.pd.certs import TlsFiles
from kvfence.pd.tls import TlsConfig


@cache
def cluster_dir() -> Path:
    d = Path(tempfile.mkdtemp(prefix="kvfence-test-tls-"))
    atexit.register(shutil.rmtree, d, True)
    return certs.cluster(d)


def files(role: str) -> TlsFiles:
    d = cluster_dir()
    return TlsFiles(str(d / f"{role}.crt"), str(d / f"{role}.key"), str(d / "ca.crt"))


def tls(role: str) -> TlsConfig:
    """A fresh TlsConfig of `role` from the cluster CA."""
    return TlsConfig(role, files(role))


@cache
def impostor(role: str) -> TlsFiles:
    """A certificate that claims `role` but comes from a CA of its own, trusting only that one."""
    return certs.self_signed(cluster_dir() / f"impostor-{role}", role)
