"""Guard overhead: the same HTTP workload against a server with kvfence's guards on and one with
them off (fault points), interleaved A/B; plus a micro-benchmark of the integrity hashing.

Guards off is unsafe by definition (it is the incident's configuration minus the placeholder), so
this script refuses to run without --i-understand-guards-off-is-unsafe. "Off" means the fault
points in GUARDS_OFF: the runner's page-ownership decision (skip_tag_check), decode's checksum and
read-back digest decision (skip_checksum: the hashing itself still runs), decode's count check
(skip_count_check). The transfer's TLS stays on either way (skip_peer_verify only skips the
certificate check, not the cipher: its cost is benchmarks/kv_transfer.py's). The micro-benchmark
measures what the still-running hashing costs in MB/s.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (  # noqa: E402
    RESULTS,
    ROOT,
    Server,
    interleaved_pairs,
    kvfence_server,
    machine,
    new_figure,
    plot_available,
    ratio_ci,
    run_bench,
    save_figure,
    this_command,
    write_json,
)

GUARDS_OFF = "skip_tag_check,skip_checksum,skip_count_check"
UNSAFE_FLAG = "--i-understand-guards-off-is-unsafe"
METRICS = {
    "throughput": lambda r: r["total_token_throughput"],
    "p99_ttft_ms": lambda r: r["ttft_ms"]["p99"],
    "p99_itl_ms": lambda r: r["itl_ms"]["p99"],
}


def guards_off_env() -> dict[str, str]:
    return {"KVFENCE_FAULT_INJECTION": "1", "KVFENCE_FAULTS": GUARDS_OFF}


def micro(page_bytes: int, pages: int, repeats: int) -> dict[str, float]:
    """xxh3 per page (the checksum) and keyed BLAKE2b (a MAC for comparison), in MB/s, against
    a plain memory copy of the same bytes."""
    import xxhash

    data = [os.urandom(page_bytes) for _ in range(pages)]
    key = os.urandom(32)
    total = page_bytes * pages

    def rate(fn) -> float:  # type: ignore[no-untyped-def]
        best = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            for d in data:
                fn(d)
            best = min(best, time.perf_counter() - t)
        return total / best / 1e6

    return {
        "page_bytes": page_bytes,
        "pages": pages,
        "xxh3_MBps": rate(xxhash.xxh3_64_intdigest),
        "blake2b_mac_MBps": rate(lambda d: hashlib.blake2b(d, key=key, digest_size=16).digest()),
        "blake2b_unkeyed_MBps": rate(lambda d: hashlib.blake2b(d, digest_size=16).digest()),
        # An alternative MAC for comparison (SHA-NI makes it faster on CPUs that have it).
        "hmac_sha256_MBps": rate(lambda d: hmac.new(key, d, hashlib.sha256).digest()),
        "memcpy_MBps": rate(bytearray),
    }


def micro_i2(batch: int, ctx_tokens: int, page_size: int, repeats: int) -> dict[str, float]:
    """Milliseconds of one batch's I2 ownership check and written-by marking (the runner's own
    code on a real pool), which skip_tag_check does not remove: it only ignores the verdict."""
    from types import SimpleNamespace

    import torch

    from kvfence.engine.runner import ModelRunner
    from kvfence.kv.pool import KVPool

    pages_per_seq = -(-ctx_tokens // page_size)
    pool = KVPool(
        num_layers=1,
        num_pages=batch * pages_per_seq,
        page_size=page_size,
        num_kv_heads=1,
        head_dim=8,
        dtype=torch.float32,
        device="cpu",
    )
    chunks = []
    for i in range(batch):
        grant = pool.new_grant(f"t{i % 4}", f"r{i}")
        seq = SimpleNamespace(pages=pool.allocate(grant, pages_per_seq), grant=grant)
        chunks.append(SimpleNamespace(seq=seq, start=ctx_tokens - 1, length=1))
    fake = SimpleNamespace(pool=pool, device=torch.device("cpu"))
    fake._page_table = lambda cs: ModelRunner._page_table(fake, cs)  # type: ignore[arg-type]
    # No prefix cache in this pool: the sealed-page part of the check is None, as with the
    # cache off.
    fake._sealed_reads = lambda cs, w, cols: ModelRunner._sealed_reads(fake, cs, w, cols)  # type: ignore[arg-type]
    fake.ownership_inputs = lambda cs: ModelRunner.ownership_inputs(fake, cs)  # type: ignore[arg-type]
    fake.ownership_flags = lambda cs: ModelRunner.ownership_flags(fake, cs)  # type: ignore[arg-type]
    fake.enforce_tag_check = lambda: True
    table = fake._page_table(chunks)
    starts = torch.zeros(batch, dtype=torch.int64)
    lengths = torch.full((batch,), ctx_tokens, dtype=torch.int64)
    ModelRunner._mark_written(fake, chunks, table, starts, lengths)  # type: ignore[arg-type]

    def best(fn) -> float:  # type: ignore[no-untyped-def]
        out = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            for _ in range(20):
                fn()
            out = min(out, (time.perf_counter() - t) / 20)
        return out * 1000

    ok, bad = ModelRunner.check_ownership(fake, chunks)  # type: ignore[arg-type]
    assert len(ok) == batch and not bad
    return {
        "batch": batch,
        "ctx_tokens": ctx_tokens,
        "check_ownership_ms": best(lambda: ModelRunner.check_ownership(fake, chunks)),
        "mark_written_ms": best(
            lambda: ModelRunner._mark_written(fake, chunks, table, starts, lengths)
        ),
    }


def run_mode(mode: str, a: argparse.Namespace, out: Path) -> dict:
    sides = {
        side: kvfence_server(
            mode,
            a.model,
            a.context_length,
            a.kv_pool_tokens,
            out / f"{mode}-{side}.log",
            env=guards_off_env() if side == "off" else None,
        )
        for side in ("off", "on")
    }

    def bench(srv: Server, seed: int) -> dict:
        return run_bench(
            srv.url,
            a.num_prompts,
            a.input_len,
            a.output_len,
            a.concurrency,
            a.vocab_size,
            seed=seed,
        )

    pairs = interleaved_pairs(sides, a.pairs, bench, METRICS, mode)
    ratios = {k: [pr["off"][k] / pr["on"][k] for pr in pairs] for k in METRICS}
    return {
        "server_commands": {side: srv.command for side, srv in sides.items()},
        "pairs": [{side: pr[side] for side in ("on", "off")} for pr in pairs],
        "ratios_off_over_on": ratios,
        "summary": {k: ratio_ci(v) for k, v in ratios.items()},
    }


def plot(result: dict, path: Path) -> None:
    fig, axes = new_figure(
        1, len(result["modes"]), figsize=(5 * len(result["modes"]), 4), squeeze=False
    )
    for ax, (mode, r) in zip(axes[0], result["modes"].items(), strict=True):
        names = list(METRICS)
        for j, k in enumerate(names):
            vals = r["ratios_off_over_on"][k]
            ax.scatter([j] * len(vals), vals, alpha=0.4, color="gray")
            s = r["summary"][k]
            if s["n"] >= 2:
                ax.errorbar(
                    [j],
                    [s["mean"]],
                    yerr=[[s["mean"] - s["lo"]], [s["hi"] - s["mean"]]],
                    fmt="o",
                    color="C0",
                    capsize=6,
                )
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks(range(len(names)), names)
        ax.set_ylabel("guards off / guards on (95% CI)")
        ax.set_title(f"kvfence {mode}: guard overhead")
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        UNSAFE_FLAG,
        dest="unsafe",
        action="store_true",
        help="required: runs a server with the isolation guards switched off",
    )
    p.add_argument("--modes", default="serve", help="comma list of serve,up")
    p.add_argument("--model", default=str(ROOT / "models" / "kvfence-tiny"))
    p.add_argument("--vocab-size", type=int, default=2048)
    p.add_argument("--context-length", type=int, default=2048)
    p.add_argument("--kv-pool-tokens", type=int, default=65536)
    p.add_argument("--pairs", type=int, default=10)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--micro-repeats", type=int, default=5)
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--name", default="guard_overhead")
    a = p.parse_args(argv)
    if not a.unsafe:
        print(
            f"refusing: this starts a server with its guards off; pass {UNSAFE_FLAG}",
            file=sys.stderr,
        )
        return 2
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    cmd = this_command()
    result: dict = {
        "command": cmd,
        "machine": machine(),
        "guards_off": GUARDS_OFF,
        "env_off": guards_off_env(),
        "workload": {
            k: getattr(a, k)
            for k in ("model", "num_prompts", "input_len", "output_len", "concurrency", "pairs")
        },
        "modes": {},
    }
    for mode in a.modes.split(","):
        result["modes"][mode] = run_mode(mode, a, out)
    # A page of the bundled model: 16 tokens x 2 layers x 1 KV head x 256 dims x fp32 x (K, V).
    result["micro"] = micro(page_bytes=16 * 2 * 256 * 4 * 2, pages=256, repeats=a.micro_repeats)
    print(f"micro: {result['micro']}")
    result["micro_i2"] = micro_i2(batch=32, ctx_tokens=320, page_size=16, repeats=a.micro_repeats)
    print(f"micro_i2: {result['micro_i2']}")
    for mode, r in result["modes"].items():
        for k, s in r["summary"].items():
            print(
                f"[{mode}] {k} off/on = {s['mean']:.3f} (95% CI {s['lo']:.3f}..{s['hi']:.3f}, "
                f"n={s['n']})"
            )
    write_json(out / f"{a.name}.json", result)
    if plot_available():
        plot(result, out / f"{a.name}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
