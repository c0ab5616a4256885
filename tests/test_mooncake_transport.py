"""The mooncake KV backend moves exactly a room's valid tokens between two KVPools (tcp on
loopback, in one process and across processes); skipped where the engine is not installed."""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Iterator

import pytest
import torch

from kvfence.kv.pool import KVPool
from kvfence.pd import kvio
from kvfence.pd.transport import mooncake

# available() imports the engine itself (after quieting its logging) and starts one on loopback.
if not mooncake.available():
    pytest.skip(
        "mooncake transfer engine missing or not starting here: " + mooncake.INSTALL_HINT,
        allow_module_level=True,
    )

PAGE = 4
NUM_PAGES = 8
SENTINEL = 7.0


def make_pool(dtype: torch.dtype) -> KVPool:
    return KVPool(
        num_layers=2,
        num_pages=NUM_PAGES,
        page_size=PAGE,
        num_kv_heads=2,
        head_dim=8,
        dtype=dtype,
        device="cpu",
    )


def fill_random(pool: KVPool, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for t in (pool.k, pool.v):
        t[:, PAGE:] = torch.randn(t[:, PAGE:].shape, generator=g).to(t.dtype)


def fill_sentinel(pool: KVPool) -> None:
    pool.k[:, PAGE:] = SENTINEL
    pool.v[:, PAGE:] = -SENTINEL


Pair = tuple[KVPool, KVPool, mooncake.MooncakeEndpoint, mooncake.MooncakeEndpoint]


@pytest.fixture(scope="module")
def endpoints() -> Iterator[dict[torch.dtype, Pair]]:
    # Module-scoped: tearing an engine down blocks for about a second inside the library.
    made: dict[torch.dtype, Pair] = {}
    for dtype in (torch.float32, torch.bfloat16):
        src, dst = make_pool(dtype), make_pool(dtype)
        made[dtype] = (src, dst, mooncake.MooncakeEndpoint(src), mooncake.MooncakeEndpoint(dst))
    yield made
    for _, _, a, b in made.values():
        a.close()
        b.close()


@pytest.fixture(params=[torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def pair(request: pytest.FixtureRequest, endpoints: dict[torch.dtype, Pair]) -> Pair:
    return endpoints[request.param]


def read_pages(pool: KVPool, pages: list[int], n_tokens: int) -> list[bytes]:
    """Per-page bytes of the first n_tokens held in `pages`, K then V, layer by layer."""
    out = []
    for first, n, count in kvio.runs(pool, n_tokens):
        run = kvio.gather(pool, pages[first : first + n], count)
        out += [
            b"".join(
                bytes(run[kv, lay, i].numpy()) for kv in range(2) for lay in range(pool.num_layers)
            )
            for i in range(n)
        ]
    return out


def assert_room_moved(
    src: KVPool,
    dst: KVPool,
    before: tuple[torch.Tensor, torch.Tensor],
    src_pages: list[int],
    dst_pages: list[int],
    n_tokens: int,
) -> None:
    assert read_pages(dst, dst_pages, n_tokens) == read_pages(src, src_pages, n_tokens)
    written = torch.zeros(dst.k.shape[1], dtype=torch.bool)
    for i, p in enumerate(dst_pages[: src.pages_for(n_tokens)]):
        count = min(PAGE, n_tokens - i * PAGE)
        written[p * PAGE : p * PAGE + count] = True
    # Everything else, including the tail of a last partial page, is bit-for-bit as before.
    for now, was in zip((dst.k, dst.v), before, strict=True):
        assert torch.equal(now[:, ~written], was[:, ~written])


# Non-consecutive pages on purpose, some consecutive on both sides, to exercise run merging.
SRC_PAGES = [2, 3, 4, 7]
DST_PAGES = [5, 6, 1, 2]


@pytest.mark.parametrize("n_tokens", [1, PAGE - 1, PAGE, PAGE + 1, 3 * PAGE, 3 * PAGE + 2])
def test_write_tokens_moves_exactly_the_valid_tokens(pair, n_tokens: int) -> None:
    src, dst, a, b = pair
    fill_random(src, seed=n_tokens)
    fill_sentinel(dst)
    before = (dst.k.clone(), dst.v.clone())
    a.write_tokens(b.descriptor(), SRC_PAGES, DST_PAGES, n_tokens)
    assert_room_moved(src, dst, before, SRC_PAGES, DST_PAGES, n_tokens)


def test_stale_tail_of_partial_page_never_leaves(pair) -> None:
    src, dst, a, b = pair
    fill_random(src, seed=1)
    src.k[:, 7 * PAGE + 1 :] = 1e4  # another tenant's leftovers behind the room's last token
    fill_sentinel(dst)
    a.write_tokens(b.descriptor(), [7], [3], 1)
    assert torch.equal(dst.k[:, 3 * PAGE], src.k[:, 7 * PAGE])
    assert bool((dst.k[:, 3 * PAGE + 1 : 4 * PAGE] == SENTINEL).all())


def test_descriptor_is_jsonable_and_consistent(pair) -> None:
    import json

    _, dst, _, b = pair
    d = json.loads(json.dumps(b.descriptor()))
    assert d["k_base"] == dst.k.data_ptr() and d["v_base"] == dst.v.data_ptr()
    assert d["total_slots"] == (NUM_PAGES + 1) * PAGE and d["num_layers"] == 2
    assert d["slot_bytes"] == 2 * 8 * dst.k.element_size()
    host, port = d["session"].rsplit(":", 1)
    assert host == "127.0.0.1" and int(port) > 0


def _bad(desc: dict, **change: object) -> dict:
    return {**desc, **change}


@pytest.mark.parametrize(
    "mutate",
    [
        lambda d: _bad(d, k_base="123"),
        lambda d: _bad(d, v_base=1.5),
        lambda d: _bad(d, slot_bytes=d["slot_bytes"] * 2),
        lambda d: _bad(d, num_layers=3),
        lambda d: _bad(d, total_slots=True),
        lambda d: _bad(d, total_slots=2 * PAGE),  # dst page 5 would lie outside
        lambda d: _bad(d, page_size=PAGE * 2),
        lambda d: _bad(d, v_base=d["k_base"] + 8),  # overlaps K
        lambda d: _bad(d, k_base=-1),
        lambda d: _bad(d, session="no-port"),
        lambda d: {k: v for k, v in d.items() if k != "k_base"},
    ],
)
def test_bad_descriptor_raises_and_writes_nothing(pair, mutate) -> None:
    src, dst, a, b = pair
    fill_random(src, seed=3)
    fill_sentinel(dst)
    before = (dst.k.clone(), dst.v.clone())
    with pytest.raises(ValueError):
        a.write_tokens(mutate(b.descriptor()), [1, 2], [5, 6], PAGE + 1)
    assert torch.equal(dst.k, before[0]) and torch.equal(dst.v, before[1])


@pytest.mark.parametrize(
    "src_pages, dst_pages, n_tokens",
    [
        ([1, 2], [0, 3], PAGE + 1),  # the null page is never a target
        ([1, 2], [3, NUM_PAGES + 1], PAGE + 1),  # past the remote pool
        ([1, 2], [3, 3], PAGE + 1),  # repeated target
        ([0, 2], [3, 4], PAGE + 1),  # local null page
        ([1], [3, 4], PAGE + 1),  # too few pages
        ([1, 2], [3, 4], -1),
    ],
)
def test_bad_pages_raise_and_write_nothing(pair, src_pages, dst_pages, n_tokens) -> None:
    src, dst, a, b = pair
    fill_random(src, seed=4)
    fill_sentinel(dst)
    before = (dst.k.clone(), dst.v.clone())
    with pytest.raises(ValueError):
        a.write_tokens(b.descriptor(), src_pages, dst_pages, n_tokens)
    assert torch.equal(dst.k, before[0]) and torch.equal(dst.v, before[1])


def test_write_outside_registered_memory_fails(pair) -> None:
    _, dst, a, b = pair
    # A descriptor that passes our checks but points past the peer's registration: the peer's
    # engine refuses it, and we must surface that as MooncakeError, not silence.
    desc = b.descriptor()
    span = dst.k.nbytes
    far = max(desc["k_base"], desc["v_base"]) + span * 4
    with pytest.raises(mooncake.MooncakeError):
        a.write_tokens({**desc, "k_base": far, "v_base": far + span}, [1], [1], 1)


def test_unreachable_peer_raises_mooncake_error(pair) -> None:
    _, _, a, b = pair
    desc = {**b.descriptor(), "session": "127.0.0.1:1"}
    with pytest.raises(mooncake.MooncakeError):
        a.write_tokens(desc, [1], [1], 1)


def test_closed_endpoint_refuses(pair) -> None:
    src, _, _, b = pair
    a = mooncake.MooncakeEndpoint(src)
    a.close()
    with pytest.raises(mooncake.MooncakeError):
        a.write_tokens(b.descriptor(), [1], [1], 1)


def _peer(conn) -> None:  # runs in a spawned process: a decode-side pool receiving one room
    from kvfence.pd.transport import mooncake as mc

    pool = make_pool(torch.bfloat16)
    fill_sentinel(pool)
    with mc.MooncakeEndpoint(pool) as ep:
        conn.send(ep.descriptor())
        pages, n_tokens = conn.recv()  # the writer says the room landed
        conn.send((read_pages(pool, pages, n_tokens), pool.k.clone(), pool.v.clone()))
        conn.recv()  # keep memory registered until the parent is done


def test_write_crosses_processes(endpoints: dict[torch.dtype, Pair]) -> None:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_peer, args=(child,), daemon=True)
    proc.start()
    try:
        assert parent.poll(60), "peer did not start"
        desc = parent.recv()
        src, _, a, _ = endpoints[torch.bfloat16]
        fill_random(src, seed=9)
        n_tokens = 2 * PAGE + 3
        a.write_tokens(desc, [1, 2, 3], [8, 4, 5], n_tokens)
        parent.send(([8, 4, 5], n_tokens))
        assert parent.poll(30)
        payloads, k, v = parent.recv()
        assert payloads == read_pages(src, [1, 2, 3], n_tokens)
        assert bool((k[:, 5 * PAGE + 3 : 6 * PAGE] == SENTINEL).all())  # partial page's tail
        assert bool((k[:, PAGE : 4 * PAGE] == SENTINEL).all())  # pages not in the room
        assert bool((v[:, 6 * PAGE : 8 * PAGE] == -SENTINEL).all())
        parent.send("done")
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    assert proc.exitcode == 0
