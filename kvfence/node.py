"""The one place a node's role is built from its NodeConfig: `kvfence serve` in process, the
engine process (kvfence/role_child.py), and the tests' harnesses all call `build_role`."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from kvfence.config import ConfigError, NodeConfig
from kvfence.faults import Faults

if TYPE_CHECKING:
    from kvfence.role import RoleService

EXIT_CAPACITY = 2


def build_role(config: NodeConfig, faults: Faults) -> RoleService:
    """The role the HTTP layer serves: unified, or a PD role, each on its own engine."""
    cfg, pd = config.engine, config.pd
    if config.role == "unified":
        from kvfence.engine.engine import Engine
        from kvfence.role import UnifiedService

        return UnifiedService(Engine(cfg, faults))
    role = config.role
    from kvfence.pd.tls import TlsConfig, load_files
    from kvfence.pd.transport.tcp import LinkLimits

    tls = TlsConfig(role, load_files(role, pd.tls_cert, pd.tls_key, pd.tls_ca))
    limits = LinkLimits(pd.tls_handshake_timeout, pd.max_pending_handshakes, pd.pd_idle_timeout)
    backend = pd.disaggregation_transfer_backend
    timeout = pd.disaggregation_timeout
    host = config.server.host
    if role == "prefill":
        from kvfence.pd.prefill import PrefillService

        port = pd.disaggregation_bootstrap_port
        return PrefillService(cfg, host, port, timeout, backend, tls, faults, limits)
    from kvfence.pd.decode import DecodeService

    host = "127.0.0.1" if host in ("0.0.0.0", "") else host
    local = pd.decode_local_prefill or 0.0
    borrow = pd.decode_borrow_threads or 0
    return DecodeService(cfg, timeout, backend, tls, faults, host, limits, local, borrow)


def startup_error(e: BaseException) -> int | None:
    """A role that cannot start: say why on stderr and return the exit status (None: a bug,
    let it raise). One rule for the serving process and the engine process."""
    from kvfence.kv.sizing import CapacityError
    from kvfence.model.config import UnsupportedModelError

    if isinstance(e, CapacityError):
        print(f"kvfence: refusing to start: {e}", file=sys.stderr)
        return EXIT_CAPACITY
    if isinstance(e, (ConfigError, UnsupportedModelError, ValueError, OSError, RuntimeError)):
        print(f"kvfence: {e}", file=sys.stderr)
        return 1
    return None
