"""One prepared check of kvfence on a device: exactness, PD, and where its speed stands.

Prints, for `--device cuda` (one GPU) or `--device cpu` (a tiny size, run by the suite):
- greedy token-exactness against transformers on the same device, float32, for a dense (llama),
  a Qwen3 and a MoE (qwen3_moe) checkpoint, tiny and random, built here, on the device's default
  path (cuda: the flex attention backend and decode captured as CUDA graphs per bucket), with
  the attention backend and graph buckets it used;
- the CUDA path forced (--attention-backend flex, --cuda-graph on, 4 rows per graph at most, so
  the batch crosses buckets and rows finish mid-batch) against transformers: on cpu the very
  code uncaptured; and the I3 read-back of a device pool (one gather, one copy) against the
  host's checksums of the same bytes;
- 1P1D over tcp: `kvfence up` with one prefill and one decode process on the device, its greedy
  answers against the unified engine's;
- decode step ms at batch 1 / 32 / 128 against the memory floor (bytes read per step over the
  copy bandwidth measured here);
- prefill tokens/s against the matmul roofline (the best matmul measured here at the model's
  shapes, in the model's dtype);
- the guards' overhead: the same decode steps with the ownership and transfer guards on and off
  (fault points), interleaved.
A check that could not run prints NOT RUN and fails the script: it is never a pass. Figures with a
goal print it beside them; goals are judged on cuda only (a tiny CPU model has no meaningful
floor). The exit status is 1 when an exactness check fails or a section could not run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
# The guard-overhead section arms guard-off fault points in this process only.
os.environ.setdefault("KVFENCE_FAULT_INJECTION", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402

from kvfence.engine.llm import LLM  # noqa: E402
from kvfence.engine.request import GenerateRequest, RequestOutput, SamplingParams  # noqa: E402
from kvfence.faults import Faults  # noqa: E402
from kvfence.model.config import ModelConfig  # noqa: E402

EXACT_ARCHS = ("llama", "qwen3", "qwen3_moe")
GUARDS_OFF = ("skip_tag_check", "skip_checksum", "skip_count_check")


@dataclass(frozen=True)
class Size:
    """How big the perf model and the workloads are."""

    perf_model: dict  # build_checkpoint overrides
    vocab: int
    batches: tuple[int, ...]
    decode_ctx: int
    decode_steps: int
    prefill_tokens: int
    dtype: str


SIZES = {
    # The suite's size: seconds on 2 CPU cores; its figures show the script runs, nothing more.
    "tiny": Size(
        dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2),
        256,
        (1, 4, 8),
        64,
        4,
        128,
        "float32",
    ),
    # One GPU: ~0.8B parameters in bf16, so a decode step reads enough bytes to have a floor.
    "gpu": Size(
        dict(
            hidden_size=2048,
            intermediate_size=5632,
            num_hidden_layers=16,
            num_attention_heads=16,
            num_key_value_heads=4,
            head_dim=128,
            max_position_embeddings=4096,
        ),
        32000,
        (1, 32, 128),
        1024,
        16,
        4096,
        "bfloat16",
    ),
}


class Report:
    def __init__(self) -> None:
        self.lines: list[dict] = []
        self.failed = False

    def add(self, section: str, ok: bool | None, **figures: object) -> None:
        """ok None: a figure with no pass/fail here; False fails the script."""
        self.lines.append({"section": section, "ok": ok, **figures})
        verdict = {True: "PASS", False: "FAIL", None: "----"}[ok]
        shown = " ".join(f"{k}={_fmt(v)}" for k, v in figures.items())
        print(f"{verdict} {section}: {shown}", flush=True)
        self.failed |= ok is False

    def section(self, name: str, fn: Callable[[], None]) -> None:
        t0 = time.perf_counter()
        try:
            fn()
        except Exception as e:
            traceback.print_exc()
            self.add(name, False, status="NOT RUN", error=f"{type(e).__name__}: {e}")
        print(f"     ({name}: {time.perf_counter() - t0:.1f} s)", flush=True)


def _fmt(v: object) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def build(arch: str, out: Path, vocab: int = 256, **overrides: object) -> Path:
    from checkpoints import build_checkpoint

    return build_checkpoint(arch, out, vocab=vocab, **overrides)


def hf_greedy_on(model_dir: Path, prompts: list[list[int]], n: int, device: str) -> list[list]:
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = model.to(device).eval()
    out = []
    for p in prompts:
        ids = model.generate(
            torch.tensor([p], device=device),
            max_new_tokens=n,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
        out.append(ids[0, len(p) :].tolist())
    return out


def random_prompts(lengths: list[int], vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab - 1, (n,), generator=g).tolist() for n in lengths]


GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


def check_exact(rep: Report, device: str, work: Path) -> None:
    lengths = [1, 15, 17, 70, 200]
    for arch in EXACT_ARCHS:
        model_dir = build(arch, work / arch)
        prompts = random_prompts(lengths, 256, seed=7)
        llm = LLM(str(model_dir), device=device, kv_pool_tokens=4096, chunked_prefill_size=48)
        got = [c.token_ids for c in llm.generate(prompts, GREEDY)]
        want = hf_greedy_on(model_dir, prompts, GREEDY.max_tokens, device)
        same = sum(g == w for g, w in zip(got, want, strict=True))
        rep.add(f"exact {arch}", same == len(prompts), prompts=len(prompts), token_exact=same,
                **_path(llm))
        del llm


def _path(llm: LLM) -> dict:
    """The attention backend a run took and the decode buckets it ran (captured on cuda)."""
    runner = llm.engine.runner
    graphs = runner.graphs
    return {
        "attention": runner.attention.name,
        "graph_buckets": sorted(graphs.steps_by_bucket) if graphs is not None else "off",
        "captured": sorted(graphs.graphs) if graphs is not None else [],
    }


def check_cuda_path(rep: Report, device: str, work: Path) -> None:
    from kvfence.kv.pool import KVPool
    from kvfence.pd import kvio

    model_dir = work / "llama"
    if not model_dir.exists():
        build("llama", model_dir)
    prompts = random_prompts([3, 17, 30, 9, 22, 5], 256, seed=9)
    steps = (3, 12, 7, 14, 5, 9)  # rows finish mid-batch: 6 rows (eager), then buckets 4, 2, 1
    llm = LLM(str(model_dir), device=device, kv_pool_tokens=1024, chunked_prefill_size=16,
              attention_backend="flex", cuda_graph="on", cuda_graph_max_bs=4)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in steps]
    got = [c.token_ids for c in llm.generate(prompts, params)]
    want = [hf_greedy_on(model_dir, [p], n, device)[0] for p, n in zip(prompts, steps, strict=True)]
    same = sum(g == w for g, w in zip(got, want, strict=True))
    rep.add("flex + decode buckets llama", same == len(prompts), prompts=len(prompts),
            token_exact=same, **_path(llm))
    del llm
    pool = KVPool(num_layers=4, num_pages=64, page_size=16, num_kv_heads=2, head_dim=64,
                  dtype=torch.bfloat16, device=device)
    pool.k.normal_()
    pool.v.normal_()
    host = KVPool(num_layers=4, num_pages=64, page_size=16, num_kv_heads=2, head_dim=64,
                  dtype=torch.bfloat16, device="cpu")
    host.k.copy_(pool.k.cpu())
    host.v.copy_(pool.v.cpu())
    pages = torch.randperm(64)[:20].add(1).tolist()
    same_sums = kvio.batched_checksums(pool, pages, 20 * 16 - 5) == kvio.pool_checksums(
        host, pages, 20 * 16 - 5)
    rep.add("read-back checksums", same_sums, pages=len(pages), pool=str(pool.k.device))


def check_pd(rep: Report, device: str, work: Path) -> None:
    from kvfence.tools.cluster import LocalCluster

    model_dir = work / "llama"
    if not model_dir.exists():
        build("llama", model_dir)
    prompts = random_prompts([3, 16, 40, 150], 256, seed=11)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    unified = [
        c.token_ids
        for c in LLM(str(model_dir), device=device, kv_pool_tokens=4096).generate(prompts, params)
    ]
    (work / "up").mkdir(exist_ok=True)
    up_args = (
        "--prefill",
        "1",
        "--decode",
        "1",
        "--device",
        device,
        "--kv-pool-tokens",
        "4096",
        "--disaggregation-transfer-backend",
        "tcp",
    )
    same = 0
    with LocalCluster(work / "up", model_dir, *up_args) as cluster:
        t0 = time.perf_counter()
        for prompt, want in zip(prompts, unified, strict=True):
            r = cluster.post(
                {
                    "model": model_dir.name,
                    "prompt": prompt,
                    "max_tokens": 8,
                    "temperature": 0,
                    "ignore_eos": True,
                    "logprobs": 0,
                    "return_tokens_as_token_ids": True,
                }
            )
            if r.status_code != 200:
                raise RuntimeError(f"1P1D answered {r.status_code}: {r.text[:300]}")
            tokens = r.json()["choices"][0]["logprobs"]["tokens"]
            same += [int(t.removeprefix("token_id:")) for t in tokens] == want
        wall = time.perf_counter() - t0
    rep.add("1P1D tcp", same == len(prompts), prompts=len(prompts), token_exact=same, wall_s=wall)


def copy_bandwidth(device: str, nbytes: int) -> float:
    """Bytes moved per second by a device copy (read + write), best of a few."""
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(10):
        sync(device)
        t = time.perf_counter()
        dst.copy_(src)
        sync(device)
        best = min(best, time.perf_counter() - t)
    return 2 * src.numel() / best


def decode_steps_ms(llm: LLM, batch: int, ctx: int, steps: int, device: str) -> list[float]:
    """Per-step ms of `steps` decode-only steps of `batch` rows at ~`ctx` tokens of context."""
    engine = llm.engine
    started: set[str] = set()
    done: set[str] = set()

    def sink(o: RequestOutput) -> None:
        if o.new_token_ids:
            started.add(o.request_id)
        if o.finished:
            done.add(o.request_id)

    params = SamplingParams(max_tokens=steps + 4, temperature=0.0, ignore_eos=True)
    vocab = ModelConfig.from_dir(engine.cfg.model).vocab_size
    prompts = random_prompts([ctx] * batch, vocab, seed=batch)
    ids = [f"d{batch}-{i}-{time.monotonic_ns()}" for i in range(batch)]
    for rid, p in zip(ids, prompts, strict=True):
        engine.submit(GenerateRequest(rid, "t", tuple(p), params), sink)
    while len(started) < batch:
        engine.step()
    times = []
    for _ in range(steps):
        sync(device)
        t = time.perf_counter()
        engine.step()
        sync(device)
        times.append((time.perf_counter() - t) * 1e3)
    while len(done) < batch:
        engine.step()
    return times


def perf_llm(model_dir: Path, size: Size, device: str, faults: Faults | None = None) -> LLM:
    tokens = max(size.batches) * (size.decode_ctx + size.decode_steps + 32) + size.prefill_tokens
    return LLM(
        str(model_dir),
        faults,
        device=device,
        dtype=size.dtype,
        kv_pool_tokens=tokens,
        chunked_prefill_size=size.prefill_tokens,
        max_running_requests=max(size.batches),
    )


def check_decode(rep: Report, device: str, size: Size, model_dir: Path) -> None:
    cfg = ModelConfig.from_dir(model_dir)
    elem = torch.finfo(getattr(torch, size.dtype)).bits // 8
    weight_bytes = cfg.num_params * elem
    kv_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * elem
    bw = copy_bandwidth(device, 1 << 30 if device.startswith("cuda") else 1 << 26)
    llm = perf_llm(model_dir, size, device)
    decode_steps_ms(llm, 1, 16, 2, device)  # warm-up
    for batch in size.batches:
        ms = statistics.median(
            decode_steps_ms(llm, batch, size.decode_ctx, size.decode_steps, device)
        )
        floor_ms = (weight_bytes + batch * size.decode_ctx * kv_per_token) / bw * 1e3
        goal = batch == 32 and device.startswith("cuda")
        rep.add(
            f"decode batch {batch}",
            (ms <= 2 * floor_ms) if goal else None,
            step_ms=ms,
            floor_ms=floor_ms,
            x_floor=ms / floor_ms,
            goal="<= 2x at batch 32 (cuda)",
        )


def matmul_roofline(device: str, dtype: torch.dtype, shapes: list[tuple[int, int, int]]) -> float:
    """The best FLOP/s measured over the model's matmul shapes (M, K, N)."""
    best = 0.0
    for m, k, n in shapes:
        a = torch.randn(m, k, device=device, dtype=dtype)
        b = torch.randn(k, n, device=device, dtype=dtype)
        a @ b
        for _ in range(5):
            sync(device)
            t = time.perf_counter()
            a @ b
            sync(device)
            best = max(best, 2 * m * k * n / (time.perf_counter() - t))
    return best


def check_prefill(rep: Report, device: str, size: Size, model_dir: Path) -> None:
    cfg = ModelConfig.from_dir(model_dir)
    t = size.prefill_tokens
    h, kvd = cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim
    shapes = [
        (t, h, cfg.num_heads * cfg.head_dim + 2 * kvd),
        (t, h, 2 * cfg.intermediate_size),
        (t, cfg.intermediate_size, h),
    ]
    roof = matmul_roofline(device, getattr(torch, size.dtype), shapes)
    llm = perf_llm(model_dir, size, device)
    prompt = random_prompts([t], cfg.vocab_size, seed=5)
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    llm.generate(random_prompts([t], cfg.vocab_size, seed=4), one)  # warm-up
    secs = []
    for i in range(3):
        sync(device)
        t0 = time.perf_counter()
        llm.generate(prompt, one, tenant=f"fresh{i}")  # another tenant: no cached prefix
        sync(device)
        secs.append(time.perf_counter() - t0)
    attn = 2 * cfg.num_layers * cfg.num_heads * cfg.head_dim * t * t  # causal QK^T + PV
    # the embedding is a lookup, and the LM head runs on the last position only
    flops = 2 * (cfg.num_active_params - cfg.num_embedding_params) * t + attn
    achieved = flops / statistics.median(secs)
    goal = device.startswith("cuda")
    rep.add(
        "prefill",
        (achieved >= 0.5 * roof) if goal else None,
        tokens=t,
        tokens_per_s=t / statistics.median(secs),
        of_roofline=achieved / roof,
        goal=">= 0.5 of roofline (cuda)",
    )


def check_guards(rep: Report, device: str, size: Size, model_dir: Path) -> None:
    off = Faults()
    for point in GUARDS_OFF:
        off.arm(point)
    on_llm, off_llm = perf_llm(model_dir, size, device), perf_llm(model_dir, size, device, off)
    batch = size.batches[1]
    ratios = []
    for _ in range(3):  # interleaved A/B: on, off, on, off, ...
        on_ms = statistics.median(
            decode_steps_ms(on_llm, batch, size.decode_ctx, size.decode_steps, device)
        )
        off_ms = statistics.median(
            decode_steps_ms(off_llm, batch, size.decode_ctx, size.decode_steps, device)
        )
        ratios.append(on_ms / off_ms)
    overhead = statistics.median(ratios) - 1
    goal = device.startswith("cuda")
    rep.add(
        "guards",
        (overhead <= 0.02) if goal else None,
        batch=batch,
        overhead=overhead,
        spread=f"{min(ratios) - 1:.3f}..{max(ratios) - 1:.3f}",
        goal="<= 0.02 (cuda)",
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda", help="cpu | cuda[:N]")
    p.add_argument(
        "--size", choices=sorted(SIZES), default=None, help="default: gpu on cuda, tiny on cpu"
    )
    p.add_argument("--json", default=None, help="also write the lines here")
    a = p.parse_args(argv)
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        print("NOT RUN: --device cuda but torch sees no CUDA device", flush=True)
        return 1
    size = SIZES[a.size or ("gpu" if a.device.startswith("cuda") else "tiny")]
    if a.device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = False  # exactness is judged in true float32
        torch.backends.cudnn.allow_tf32 = False
        print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}", flush=True)
    rep = Report()
    with tempfile.TemporaryDirectory(prefix="kvfence-device-check-") as tmp:
        work = Path(tmp)
        rep.section("exactness", lambda: check_exact(rep, a.device, work))
        rep.section("cuda path", lambda: check_cuda_path(rep, a.device, work))
        rep.section("1P1D", lambda: check_pd(rep, a.device, work))
        perf_dir = work / "perf"
        rep.section("perf model", lambda: build("llama", perf_dir, size.vocab, **size.perf_model))
        if perf_dir.exists():
            rep.section("decode", lambda: check_decode(rep, a.device, size, perf_dir))
            rep.section("prefill", lambda: check_prefill(rep, a.device, size, perf_dir))
            rep.section("guards", lambda: check_guards(rep, a.device, size, perf_dir))
    if a.json:
        Path(a.json).write_text(json.dumps(rep.lines, indent=1))
    print("device check:", "FAILED" if rep.failed else "passed", flush=True)
    return 1 if rep.failed else 0


if __name__ == "__main__":
    sys.exit(main())
