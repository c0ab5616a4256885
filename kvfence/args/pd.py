"""A PD worker's options (serve; `up` forwards TRANSFER_OPTIONS to every worker): one field of
PdConfig each."""

from __future__ import annotations

from kvfence.args.option import Option, field_options
from kvfence.config import DISAGGREGATION_MODES, TRANSFER_BACKENDS, PdConfig

_pd = field_options(PdConfig)

DISAGGREGATION_MODE = _pd(
    ("--disaggregation-mode",), "disaggregation_mode", choices=DISAGGREGATION_MODES
)
BOOTSTRAP_PORT = _pd(
    ("--disaggregation-bootstrap-port",), "disaggregation_bootstrap_port", type=int
)
TRANSFER_BACKEND = _pd(
    ("--disaggregation-transfer-backend",),
    "disaggregation_transfer_backend",
    choices=TRANSFER_BACKENDS,
)
# I8: every PD connection is mutual TLS 1.3 with certificates of the cluster CA (pd/tls.py).
# Per worker, so `up` makes its own for each and does not forward these.
TLS_CERT = _pd(
    ("--tls-cert",),
    "tls_cert",
    metavar="PEM",
    help="this worker's certificate (its role: prefill or decode) from the cluster CA",
)
TLS_KEY = _pd(("--tls-key",), "tls_key", metavar="PEM", help="its private key (mode 0600)")
TLS_CA = _pd(
    ("--tls-ca",),
    "tls_ca",
    metavar="PEM",
    help="the cluster CA: peers must hold a certificate it issued (or KVFENCE_TLS_DIR)",
)
TLS_FILE_OPTIONS: tuple[Option, ...] = (TLS_CERT, TLS_KEY, TLS_CA)
TLS_HANDSHAKE_TIMEOUT = _pd(
    ("--tls-handshake-timeout",),
    "tls_handshake_timeout",
    type=float,
    help="seconds an unauthenticated peer has to complete its TLS handshake",
)
MAX_PENDING_HANDSHAKES = _pd(
    ("--max-pending-handshakes",),
    "max_pending_handshakes",
    type=int,
    help="connections the bootstrap port lets handshake at once; more are closed on accept",
)
PD_IDLE_TIMEOUT = _pd(
    ("--pd-idle-timeout",),
    "pd_idle_timeout",
    type=float,
    help="seconds a decode keeps a prefill connection that carries no transfer",
)
DISAGGREGATION_TIMEOUT = _pd(
    ("--disaggregation-timeout",),
    "disaggregation_timeout",
    type=float,
    help="seconds a KV transfer may take before it is aborted, from RESERVE (so a prompt's "
    "queueing at a busy prefill counts); SGLang's waiting timeout is also 300 s",
)
DECODE_LOCAL_PREFILL = _pd(
    ("--decode-local-prefill",),
    "decode_local_prefill",
    type=float,
    metavar="FACTOR",
    help="a decode worker computes a prompt itself, beside its decodes, when the prefill "
    "worker's queue of its prompts is FACTOR times its own (0: never; `kvfence up`: 3)",
)
DECODE_BORROW_THREADS = _pd(
    ("--decode-borrow-threads",),
    "decode_borrow_threads",
    type=int,
    metavar="N",
    help="a decode worker's steps run on N more CPU threads while none of its prompts is at "
    "the prefill worker, whose cores are idle then on a host the two share (on top of "
    "--threads, without which it is off; 0: never; `kvfence up` with one prefill and one "
    "decode on CPU: the prefill worker's share)",
)
TRANSFER_OPTIONS: tuple[Option, ...] = (
    TRANSFER_BACKEND,
    DECODE_LOCAL_PREFILL,
    DECODE_BORROW_THREADS,
    DISAGGREGATION_TIMEOUT,
    TLS_HANDSHAKE_TIMEOUT,
    MAX_PENDING_HANDSHAKES,
    PD_IDLE_TIMEOUT,
)
PD_OPTIONS: tuple[Option, ...] = (
    DISAGGREGATION_MODE,
    BOOTSTRAP_PORT,
    *TRANSFER_OPTIONS,
    *TLS_FILE_OPTIONS,
)
