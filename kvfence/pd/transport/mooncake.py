"""The mooncake KV backend: one-sided writes of a room's valid tokens from this process's KVPool
straight into a peer's KVPool through the Mooncake Transfer Engine (P2P handshake, no metadata
server).

Address math (both pools): slot (l, s) of K lives at k_base + (l * total_slots + s) * slot_bytes,
V likewise from v_base. A page's valid tokens in one layer are one contiguous run, so a room is
at most 2 * num_layers * n_pages segments, fewer where src and dst pages are both consecutive.
"""

from __future__ import annotations

import functools
import os
import threading
from typing import Any

from kvfence.kv.pool import NULL_PAGE
from kvfence.pd.kvio import PageTensors

INSTALL_HINT = (
    "install it with `pip install 'kvfence[mooncake]'` (mooncake-transfer-engine-non-cuda; "
    "mooncake-transfer-engine on CUDA hosts) and its system libraries with "
    "`apt-get install libibverbs1 librdmacm1 liburing2 libnuma1`"
)

DESCRIPTOR_INTS = ("k_base", "v_base", "slot_bytes", "total_slots", "num_layers")
_ADDR_LIMIT = 1 << 64


class MooncakeUnavailable(RuntimeError):
    """The mooncake package or a system library it links is missing, or the engine won't start."""


class MooncakeError(RuntimeError):
    """A transfer (or registration) failed; the remote pages hold undefined data."""


def _engine_module() -> Any:
    # The engine reads MC_LOG_LEVEL once, at import: without it every engine start prints ~10
    # INFO/WARNING lines (no RDMA devices, ports) to stderr. An explicit setting still wins.
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    try:
        import mooncake.engine as engine
    except ImportError as e:  # also what a missing libibverbs.so.1 looks like
        raise MooncakeUnavailable(
            f"mooncake transfer engine not importable ({e}); {INSTALL_HINT}"
        ) from e
    return engine


def _start_engine(hostname: str, protocol: str, device_name: str) -> Any:
    engine = _engine_module()
    te = engine.TransferEngine()
    # "P2PHANDSHAKE": peers exchange segment metadata over the engine's own RPC port, so the
    # session id "host:rpc_port" is all a peer needs; no etcd/http metadata server.
    rc = te.initialize(hostname, "P2PHANDSHAKE", protocol, device_name)
    if rc != 0:
        raise MooncakeUnavailable(
            f"TransferEngine.initialize({hostname!r}, P2PHANDSHAKE, {protocol!r}, "
            f"{device_name!r}) returned {rc}"
        )
    return te


@functools.cache
def available() -> bool:
    """True if the engine imports and a tcp engine starts on loopback (checked once per process)."""
    try:
        _start_engine("127.0.0.1", "tcp", "")
    except Exception:
        return False
    return True


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


class MooncakeEndpoint:
    """One process's Mooncake Transfer Engine with its KV pool's K and V tensors registered."""

    def __init__(
        self,
        pool: PageTensors,
        hostname: str = "127.0.0.1",
        protocol: str = "tcp",
        device_name: str = "",
    ) -> None:
        if not (pool.k.is_contiguous() and pool.v.is_contiguous()):
            raise ValueError("KVPool K/V must be contiguous to be addressed by slot")
        self.view = pool
        self.hostname = hostname
        self.page_size = pool.page_size
        self.num_layers = pool.num_layers
        self.total_slots = pool.k.shape[1]
        self.slot_bytes = pool.k[0, 0].numel() * pool.k.element_size()
        self._k_base = pool.k.data_ptr()
        self._v_base = pool.v.data_ptr()
        self._engine = _start_engine(hostname, protocol, device_name)
        self._registered: list[int] = []
        self._closed = False
        self._lock = threading.Lock()
        try:
            for t in (pool.k, pool.v):
                rc = self._engine.register_memory(t.data_ptr(), t.nbytes)
                if rc != 0:
                    raise MooncakeError(f"register_memory({t.nbytes} bytes) returned {rc}")
                self._registered.append(t.data_ptr())
        except BaseException:
            self.close()
            raise
        self.session = f"{hostname}:{self._engine.get_rpc_port()}"

    def descriptor(self) -> dict:
        """What a peer needs to write into this pool; JSON-able. page_size is extra to the
        address math and checked when present."""
        return {
            "session": self.session,
            "k_base": self._k_base,
            "v_base": self._v_base,
            "slot_bytes": self.slot_bytes,
            "total_slots": self.total_slots,
            "num_layers": self.num_layers,
            "page_size": self.page_size,
        }

    def _check_remote(self, remote: dict, dst_pages: list[int]) -> None:
        if not isinstance(remote, dict):
            raise ValueError("remote descriptor must be a dict")
        session = remote.get("session")
        host, sep, port = session.rpartition(":") if isinstance(session, str) else ("", "", "")
        if not (sep and host and port.isdigit() and 0 < int(port) < 65536):
            raise ValueError(f"remote session must be 'host:port', got {session!r}")
        for key in DESCRIPTOR_INTS:
            if not _is_int(remote.get(key)):
                raise ValueError(f"remote descriptor field {key!r} must be an int")
        if remote["slot_bytes"] != self.slot_bytes:
            raise ValueError(
                f"remote slot_bytes {remote['slot_bytes']} != local {self.slot_bytes} "
                "(dtype, kv heads or head_dim differ)"
            )
        if remote["num_layers"] != self.num_layers:
            raise ValueError(f"remote num_layers {remote['num_layers']} != local {self.num_layers}")
        if "page_size" in remote and remote["page_size"] != self.page_size:
            raise ValueError(f"remote page_size {remote['page_size']!r} != local {self.page_size}")
        total = remote["total_slots"]
        if total <= 0 or total % self.page_size:
            raise ValueError(f"remote total_slots {total} is not a positive multiple of a page")
        span = self.num_layers * total * self.slot_bytes
        k, v = remote["k_base"], remote["v_base"]
        for base in (k, v):
            if not 0 < base < base + span <= _ADDR_LIMIT:
                raise ValueError(
                    f"remote base {base:#x} + {span} bytes is not a valid address range"
                )
        if k < v + span and v < k + span:
            raise ValueError("remote K and V ranges overlap")
        remote_pages = total // self.page_size
        for p in dst_pages:
            # The null page is zeroed padding every gather may read: never a write target.
            if not _is_int(p) or not NULL_PAGE < p < remote_pages:
                raise ValueError(f"dst page {p!r} outside remote pages 1..{remote_pages - 1}")
        if len(set(dst_pages)) != len(dst_pages):
            raise ValueError("dst pages repeat")

    def _segments(
        self, remote: dict, src_pages: list[int], dst_pages: list[int], n_tokens: int
    ) -> tuple[list[int], list[int], list[int]]:
        ps, sb = self.page_size, self.slot_bytes
        full, rest = divmod(n_tokens, ps)
        counts = [ps] * full + ([rest] if rest else [])
        runs: list[tuple[int, int, int]] = []
        for s, d, c in zip(src_pages, dst_pages, counts, strict=True):
            if runs:
                rs, rd, rc = runs[-1]
                # rc is a whole number of pages here: only the room's last page is partial.
                if s == rs + rc // ps and d == rd + rc // ps:
                    runs[-1] = (rs, rd, rc + c)
                    continue
            runs.append((s, d, c))
        local_layer = self.total_slots * sb
        remote_layer = remote["total_slots"] * sb
        srcs: list[int] = []
        dsts: list[int] = []
        lens: list[int] = []
        for src_base, dst_base in (
            (self._k_base, remote["k_base"]),
            (self._v_base, remote["v_base"]),
        ):
            for layer in range(self.num_layers):
                src_l = src_base + layer * local_layer
                dst_l = dst_base + layer * remote_layer
                for s, d, c in runs:
                    srcs.append(src_l + s * ps * sb)
                    dsts.append(dst_l + d * ps * sb)
                    lens.append(c * sb)
        return srcs, dsts, lens

    def write_tokens(
        self, remote: dict, src_pages: list[int], dst_pages: list[int], n_tokens: int
    ) -> None:
        """Write the first n_tokens tokens held in local src_pages (in order) into the remote
        pool's dst_pages (in order), every layer, K and V, in one blocking batch. Only valid
        tokens move: the stale tail of a last partial page stays local, and the remote tail of
        that page is left as it was. Bad arguments raise ValueError before any byte moves; a
        failed transfer raises MooncakeError (remote pages then hold undefined data)."""
        if not _is_int(n_tokens) or n_tokens < 0:
            raise ValueError(f"n_tokens must be a non-negative int, got {n_tokens!r}")
        n_pages = -(-n_tokens // self.page_size)
        if len(src_pages) < n_pages or len(dst_pages) < n_pages:
            raise ValueError(
                f"{n_tokens} tokens need {n_pages} pages; got {len(src_pages)} src, "
                f"{len(dst_pages)} dst"
            )
        src_pages, dst_pages = list(src_pages[:n_pages]), list(dst_pages[:n_pages])
        for p in src_pages:
            if not _is_int(p) or not NULL_PAGE < p <= self.view.num_pages:
                raise ValueError(f"src page {p!r} outside local pages 1..{self.view.num_pages}")
        self._check_remote(remote, dst_pages)
        if n_pages == 0:
            return
        srcs, dsts, lens = self._segments(remote, src_pages, dst_pages, n_tokens)
        if self.view.k.is_cuda:
            # The engine reads device memory behind torch's back: queued kernels that write
            # these pages must have finished first.
            import torch

            torch.cuda.synchronize(self.view.device)
        with self._lock:
            if self._closed:
                raise MooncakeError("endpoint is closed")
            try:
                rc = self._engine.batch_transfer_sync_write(remote["session"], srcs, dsts, lens)
            except Exception as e:  # pybind raises on e.g. an unparsable session
                raise MooncakeError(f"batch_transfer_sync_write to {remote['session']}: {e}") from e
        if rc != 0:
            raise MooncakeError(
                f"batch_transfer_sync_write of {len(lens)} segments ({sum(lens)} bytes) to "
                f"{remote['session']} returned {rc}"
            )

    def close(self) -> None:
        """Unregister the pool's memory; later writes into this pool by peers are refused. The
        engine's listening sockets go when the endpoint is garbage collected."""
        with self._lock:
            self._closed = True
            while self._registered:
                self._engine.unregister_memory(self._registered.pop())

    def __enter__(self) -> MooncakeEndpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
