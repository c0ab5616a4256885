"""ModelRunner: turns a step's scheduled chunks into batched tensors, checks page ownership (I2),
runs the model and samples. It owns no scheduling state."""

from __future__ import annotations

import logging
from array import array
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from itertools import accumulate, chain
from typing import TypeVar

import torch

from kvfence.config import EngineConfig
from kvfence.engine.decode_graphs import DecodeGraphs, DecodeInputs
from kvfence.engine.prompt_logprobs import BLOCK_ROWS, ScoreBlock, score
from kvfence.engine.scheduler import ScheduledChunk
from kvfence.faults import Faults
from kvfence.kv.pool import NULL_PAGE, KVPool, SealedReads
from kvfence.lora.slots import LoraSlots
from kvfence.model import kernels
from kvfence.model.attention import AttentionMetadata
from kvfence.model.attn import PagedRows, select_backend
from kvfence.model.linear import onednn_prepacks
from kvfence.model.llama import CausalLM
from kvfence.model.sampling import SampleResult, SamplingBatch, sample
from kvfence.structured.grammar import Grammars

T = TypeVar("T")
log = logging.getLogger(__name__)
NO_NAMESPACE = -4  # a row outside the prefix cache (PD modes): matches no sealed page


@dataclass
class StepResult:
    sampled: list[ScheduledChunk]  # chunks that produced a token, in `samples` row order
    samples: SampleResult | None
    rejected: list[ScheduledChunk]  # failed the ownership check: fail closed, not run
    scored: list[ScheduledChunk] = field(default_factory=list)  # chunks that scored prompt
    scores: ScoreBlock | None = None  # their positions' scores, in `scored` order


@dataclass
class Forward:
    logits: torch.Tensor | None  # [rows that sample, V]; None: no row samples
    scores: ScoreBlock | None  # the scored prompt positions (rank 0 only)


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        pool: KVPool,
        device: torch.device,
        seed: int,
        attention_backend: str = "auto",
        linear_backend: str = "auto",
        faults: Faults | None = None,
        grammars: Grammars | None = None,
    ) -> None:
        self.model = model
        self.scores_here = True  # a tensor-parallel follower has only a slice of the vocab
        self.grammars = grammars  # masks constrained rows; None: no row may be constrained
        self.faults = faults if faults is not None else Faults()
        model.fuse_projections()
        self.pool = pool
        self.kv_caches = pool.layer_caches()  # the model sees these views, never the pool
        self.device = device
        self.sliding_window = model.config.sliding_window
        self.generator = torch.Generator(device=device).manual_seed(seed)
        cpu = device.type == "cpu"
        dtype = next(model.parameters()).dtype
        # Chosen once per device and dtype: every step's groups are planned by it.
        self.attention = select_backend(attention_backend, device, dtype, pool.k.dtype, NULL_PAGE)
        if self.attention.name == "flex":
            _finite_pool(pool)
        gemm = _native_kernel(
            linear_backend,
            "--linear-backend",
            cpu and dtype in (torch.float32, torch.bfloat16),
            kernels.packed_gemm_bf16 if dtype == torch.bfloat16 else kernels.packed_gemm,
            "a CPU device, float32 weights or bfloat16 ones on a host with bf16 dot products",
        )
        if gemm is not None:  # else torch's matmuls on the plain transposed weights
            model.pack_projections(gemm)
        self.packed_linear = gemm is not None
        # bf16 on CPU without bf16 dot products: oneDNN's matmul over weights reordered once,
        # not at every call.
        self.onednn_linear = onednn_prepacks(
            linear_backend, cpu, dtype == torch.bfloat16, gemm is not None
        )
        if self.onednn_linear:
            model.prepack_onednn()
        # The small ops between the projections (residual add + RMSNorm, silu * up, rope + the
        # K/V cache write) follow the same flag: one native call each instead of a chain of torch
        # ops (benchmarks/RESULTS.md "Kernels").
        epilogue = _native_kernel(
            linear_backend,
            "--linear-backend",
            cpu and dtype in (torch.float32, torch.bfloat16),
            kernels.fused_epilogue,
            "a CPU device, float32 or bfloat16 weights",
        )
        if epilogue is not None:  # else torch's F.rms_norm, add and silu
            model.use_epilogue(epilogue, pool.k.dtype)
        self.fused_epilogue = epilogue is not None
        self.lora: LoraSlots | None = None  # set by the engine with --enable-lora
        self.graphs: DecodeGraphs | None = None  # set by use_decode_graphs

    def run(self, chunks: list[ScheduledChunk]) -> StepResult:
        chunks, rejected = self.check_ownership(chunks)
        if not chunks:
            return StepResult([], None, rejected)
        sampled = [c for c in chunks if c.samples]
        # Structured-output masks are computed on llguidance's threads (no GIL) while the
        # model runs: they depend only on tokens already sampled.
        masks = self._start_masks(sampled)
        out = self.forward(chunks)
        scored = [c for c in chunks if c.scored[1] > c.scored[0]]
        if out.logits is None:
            return StepResult([], None, rejected, scored, out.scores)
        bitmask = masks.result() if masks is not None else None
        return StepResult(
            sampled,
            sample(out.logits, self._sampling_batch(sampled, bitmask), self.generator),
            rejected,
            scored,
            out.scores,
        )

    def forward(self, chunks: list[ScheduledChunk]) -> Forward:
        """Write the chunks' K/V; return the logits of the rows that sample and the scores of
        the prompt positions the chunks score. The chunks passed the ownership check."""
        page_table = self._page_table(chunks)
        starts = torch.tensor([c.start for c in chunks], dtype=torch.int64)
        lens = [c.length for c in chunks]
        lengths = torch.tensor(lens, dtype=torch.int64)
        self._mark_written(chunks, page_table, starts, lengths)
        if self.lora is not None:  # rows grouped by adapter slot, once for every site
            self.lora.prepare([c.seq.lora for c in chunks], lengths)
        # Each row's last token, from the host's own lengths: no read back per row.
        ends = list(accumulate(lens))
        flat_offsets = torch.cumsum(lengths, 0) - lengths
        total = ends[-1]
        row = torch.repeat_interleave(torch.arange(len(chunks)), lengths)
        positions = starts[row] + torch.arange(total) - flat_offsets[row]
        ps = self.pool.page_size
        slots = page_table[row, positions // ps] * ps + positions % ps
        input_ids = torch.tensor(
            list(
                chain.from_iterable(c.seq.token_ids[c.start : c.start + c.length] for c in chunks)
            ),
            dtype=torch.int64,
        )
        graphs = self.graphs
        if (graphs is not None and self.lora is None and max(lens) == 1
                and graphs.fits(len(chunks), page_table.shape[1])):
            hidden = graphs.run(DecodeInputs(input_ids, positions, slots, starts + 1, page_table))
        else:
            hidden = self._eager(chunks, page_table, starts, lengths, flat_offsets, input_ids,
                                 positions, slots)
        last_rows = [end - 1 for end, c in zip(ends, chunks, strict=True) if c.samples]
        logits = None
        if last_rows:
            logits = self.model.logits(hidden[torch.tensor(last_rows, device=self.device)])
        return Forward(logits, self._score_prompts(chunks, hidden, flat_offsets))

    def _eager(
        self,
        chunks: list[ScheduledChunk],
        page_table: torch.Tensor,
        starts: torch.Tensor,
        lengths: torch.Tensor,
        flat_offsets: torch.Tensor,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
    ) -> torch.Tensor:
        """The step's hidden states, each group of rows planned by the attention backend."""
        ps = self.pool.page_size
        groups = []
        window = self.sliding_window or 0
        for is_decode in (True, False):
            idx = [i for i, c in enumerate(chunks) if (c.length == 1) == is_decode]
            if idx:
                sel = torch.tensor(idx, dtype=torch.int64)
                ends_at = [chunks[i].start + chunks[i].length for i in idx]  # each row's context
                ctx = torch.tensor(ends_at, dtype=torch.int64)
                pages_needed = self.pool.pages_for(max(ends_at))
                rows = PagedRows(
                    q_starts=flat_offsets[sel],
                    q_lens=lengths[sel],
                    ctx_lens=ctx,
                    page_table=page_table[sel, :pages_needed].contiguous(),
                    page_size=ps,
                    window=window,
                    covers_step=len(idx) == len(chunks) and is_decode,
                )
                groups.append(self.attention.plan(rows))
        meta = AttentionMetadata(positions.to(self.device), slots.to(self.device), groups)
        return self.model(input_ids.to(self.device), meta, self.kv_caches)

    def use_decode_graphs(self, cfg: EngineConfig, max_pages: int) -> None:
        """--cuda-graph: decode-only steps of up to --cuda-graph-max-bs rows run per batch-size
        bucket from static buffers (engine/decode_graphs.py), captured on CUDA when the attention
        backend plans on the device (flex); `on` runs the same path uncaptured on CPU (tests)."""
        mode, max_bs = cfg.cuda_graph, min(cfg.cuda_graph_max_bs, cfg.max_running_requests)
        if mode == "off" or (mode == "auto" and self.device.type != "cuda"):
            return
        mc = self.model.config
        graphs = DecodeGraphs(
            self.model, self.kv_caches, self.attention, page_size=self.pool.page_size,
            window=self.sliding_window or 0, null_page=NULL_PAGE, max_bs=max_bs,
            max_pages=max_pages, hidden_size=mc.hidden_size,
            dtype=next(self.model.parameters()).dtype, device=self.device,
        )
        if self.device.type == "cuda":
            if self.attention.name != "flex":
                log.warning("--cuda-graph: the %s attention backend cannot be captured; decode "
                            "runs eagerly", self.attention.name)
                return
            try:
                graphs.capture()
            except Exception:  # noqa: BLE001 - a model with a host sync (MoE routing) runs eagerly
                log.warning("--cuda-graph: capture failed; decode runs eagerly", exc_info=True)
                return
        self.graphs = graphs

    def _score_prompts(
        self, chunks: list[ScheduledChunk], hidden: torch.Tensor, flat_offsets: torch.Tensor
    ) -> ScoreBlock | None:
        """log_softmax, rank and top-k at every scored prompt position, in blocks of rows (every
        rank makes the same logits calls: under tensor parallelism each is a gather)."""
        spans = [(i, c) for i, c in enumerate(chunks) if c.scored[1] > c.scored[0]]
        if not spans:
            return None
        rows = torch.cat(
            [
                torch.arange(c.scored[0], c.scored[1]) - c.start + int(flat_offsets[i])
                for i, c in spans
            ]
        ).to(self.device)
        targets = k = None
        if self.scores_here:
            targets = torch.tensor(
                list(chain.from_iterable(c.seq.token_ids[c.scored[0] + 1 : c.scored[1] + 1]
                                         for _, c in spans)),
                dtype=torch.int64,
            )
            k = max(c.seq.prompt_scores.k for _, c in spans)
        blocks = []
        for lo in range(0, len(rows), BLOCK_ROWS):
            logits = self.model.logits(hidden[rows[lo : lo + BLOCK_ROWS]])
            if targets is not None:
                blocks.append(score(logits, targets[lo : lo + BLOCK_ROWS], k))
        return ScoreBlock.cat(blocks) if blocks else None

    def _start_masks(self, sampled: list[ScheduledChunk]) -> Future[torch.Tensor] | None:
        constrained = [(c.seq.matcher, i) for i, c in enumerate(sampled) if c.seq.matcher]
        if not constrained or not self.faults.guards().on("grammar_mask"):
            return None
        assert self.grammars is not None, "a constrained row needs the engine's grammars"
        return self.grammars.fill_bitmask_async(constrained, len(sampled))  # type: ignore[arg-type]

    def _page_table(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        width = max(len(c.seq.pages) for c in chunks)
        return torch.tensor(
            [c.seq.pages + [NULL_PAGE] * (width - len(c.seq.pages)) for c in chunks],
            dtype=torch.int64,
        )

    def _mark_written(
        self,
        chunks: list[ScheduledChunk],
        table: torch.Tensor,
        starts: torch.Tensor,
        lengths: torch.Tensor,
    ) -> None:
        """The pages this step writes will hold their grant's data (one scatter per batch)."""
        ps = self.pool.page_size
        cols = torch.arange(table.shape[1])[None, :]
        hit = (cols >= (starts // ps)[:, None]) & (cols <= ((starts + lengths - 1) // ps)[:, None])
        grants = torch.tensor([c.seq.grant.grant_id for c in chunks])[:, None].expand_as(table)
        self.pool.mark_written(grants[hit].to(self.device), table[hit].to(self.device))

    def check_ownership(
        self, chunks: list[ScheduledChunk]
    ) -> tuple[list[ScheduledChunk], list[ScheduledChunk]]:
        """I2: every page a chunk reads or writes must be owned by its grant and tenant, and the
        pages it reads (those before this chunk) must hold data written under that grant."""
        if not chunks:
            return chunks, []
        bad = self.ownership_flags(chunks).tolist()
        if not any(bad) or not self.enforce_tag_check():
            return chunks, []
        return [c for c, b in zip(chunks, bad, strict=True) if not b], [
            c for c, b in zip(chunks, bad, strict=True) if b
        ]

    def enforce_tag_check(self) -> bool:
        """Whether a failed row is dropped (off only in the skip_tag_check twin)."""
        return self.faults.guards().on("tag_check")

    def ownership_flags(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        """bool [B]: the rows that fail the ownership check (I2), one compare over the batch."""
        return self.pool.check_owned(*self.ownership_inputs(chunks))

    def ownership_inputs(
        self, chunks: list[ScheduledChunk]
    ) -> tuple[
        torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, SealedReads | None
    ]:
        """KVPool.check_owned's arguments for the batch: page table, grants, tenants, valid,
        must-hold and the sealed reads."""
        table = self._page_table(chunks).to(self.device)
        counts = torch.tensor([len(c.seq.pages) for c in chunks], device=self.device)
        held = torch.tensor([self.pool.pages_for(c.start) for c in chunks], device=self.device)
        cols = torch.arange(table.shape[1], device=self.device)[None, :]
        valid = cols < counts[:, None]
        must_hold = cols < held[:, None]
        grants = torch.tensor([c.seq.grant.grant_id for c in chunks], device=self.device)
        tenants = torch.tensor([c.seq.grant.tenant_id for c in chunks], device=self.device)
        sealed = self._sealed_reads(chunks, table.shape[1], cols)
        return table, grants, tenants, valid, must_hold, sealed

    def _sealed_reads(
        self, chunks: list[ScheduledChunk], width: int, cols: torch.Tensor
    ) -> SealedReads | None:
        """Which sealed pages each row may read: those wholly before its chunk whose key is its
        prefix's key there, in its namespace (None: no prefix cache, so no sealed page)."""
        prefix = self.pool.prefix
        if prefix is None:
            return None
        zeros = array("q", bytes(8 * width))
        tags, ns = array("q"), []
        for c in chunks:
            keys = c.seq.chain
            n = min(len(keys.tags), width) if keys is not None else 0
            if n:
                tags.extend(keys.tags[:n])
            tags.extend(zeros[: width - n])
            ns.append(prefix.namespace_id(keys.tenant_ns) if keys is not None else NO_NAMESPACE)
        ps = self.pool.page_size
        first_written = torch.tensor([c.start // ps for c in chunks], device=self.device)
        key_tags = torch.frombuffer(tags, dtype=torch.int64).view(len(chunks), width)
        return SealedReads(
            read_only=cols < first_written[:, None],
            ns_ids=torch.tensor(ns, dtype=torch.int64, device=self.device),
            key_tags=key_tags.to(self.device, copy=True),
            namespace=self.faults.guards().on("prefix_namespace"),
        )

    def _sampling_batch(
        self, chunks: list[ScheduledChunk], bitmask: torch.Tensor | None = None
    ) -> SamplingBatch:
        params = [c.seq.admitted.request.sampling for c in chunks]
        lp = [p.logprobs for p in params if p.logprobs is not None]
        return SamplingBatch(
            temperature=torch.tensor([p.temperature for p in params], dtype=torch.float32),
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32),
            top_k=torch.tensor([p.top_k for p in params], dtype=torch.int64),
            generators=[c.seq.generator for c in chunks],
            needs_filter=any(p.top_p < 1.0 or p.top_k > 0 for p in params),
            all_greedy=all(p.greedy for p in params),
            max_logprobs=max(lp) if lp else None,
            bitmask=bitmask,
        )


def _finite_pool(pool: KVPool) -> None:
    """flex_attention multiplies the masked keys it loads (a row's last page's tail; unfused on
    CPU, every slot) by 0 in P.V, and 0 * NaN is NaN: the pool's never-written memory (torch.empty)
    is zeroed once here, and what later steps leave behind is K/V, finite. Pages stay unzeroed on
    free: no answer depends on what a masked slot holds, as long as it is finite."""
    if pool.poison_on_free:
        raise RuntimeError("--attention-backend flex reads masked slots times 0: it cannot run "
                           "with --kv-poison-on-free (NaN in freed pages)")
    pool.k.zero_()
    pool.v.zero_()


def _native_kernel(
    backend: str, flag: str, usable: bool, build: Callable[[], T | None], needs: str
) -> T | None:
    """A native kernel when `backend` allows it and it applies (`usable`, and it builds here);
    None means the torch path. `native` fails loudly instead of falling back."""
    if backend == "torch":
        return None
    kernel = build() if usable else None
    if kernel is None and backend == "native":
        raise RuntimeError(
            f"{flag} native: the kernel needs {needs} and a C++ toolchain (g++, ninja); see the "
            "log for the build error"
        )
    return kernel
