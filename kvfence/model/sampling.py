"""Batched sampling: greedy, temperature, top-k, top-p, per-request seeds, optional logprobs."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SamplingBatch:
    temperature: torch.Tensor  # [B] float32; 0 = greedy
    top_p: torch.Tensor  # [B]
    top_k: torch.Tensor  # [B] int64; <= 0 = off
    generators: list[torch.Generator | None]  # per row; None = the engine's shared generator
    needs_filter: bool  # any top-k or top-p in effect
    all_greedy: bool
    max_logprobs: int | None  # largest top-k logprobs any row asked for; None = no row asked
    # Structured outputs: [B, ceil(V/32)] int32 bits of the tokens each row may sample (all ones
    # on a free row); None when no row in the batch is constrained.
    bitmask: torch.Tensor | None = None


@dataclass
class SampleResult:
    token_ids: torch.Tensor  # [B] int64 (CPU)
    chosen_logprobs: torch.Tensor | None  # [B]
    top_ids: torch.Tensor | None  # [B, K]
    top_logprobs: torch.Tensor | None


_BITS = torch.arange(32, dtype=torch.int32)


def allowed_tokens(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, V] bool from a [B, ceil(V/32)] int32 bitmask (bit j of word w is token 32w + j)."""
    bits = (bitmask[:, :, None] >> _BITS.to(bitmask.device)) & 1
    return bits.view(bitmask.shape[0], -1)[:, :vocab].bool()


def sample(logits: torch.Tensor, sb: SamplingBatch, shared: torch.Generator) -> SampleResult:
    """logits [B, V] float32. Logprobs are the model's own (before any grammar mask)."""
    raw = logits
    if sb.bitmask is not None:
        # One op over the batch; a free row's all-ones bits leave its logits bit-identical.
        allowed = allowed_tokens(sb.bitmask.to(logits.device), logits.shape[1])
        logits = logits.masked_fill(~allowed, float("-inf"))
    greedy_ids = logits.argmax(dim=-1)
    if sb.all_greedy:
        ids = greedy_ids
    else:
        temp = sb.temperature.to(logits.device)
        scaled = logits / torch.where(temp > 0, temp, 1.0)[:, None]
        if sb.needs_filter:
            scaled = _filter_top_k_top_p(
                scaled, sb.top_k.to(logits.device), sb.top_p.to(logits.device)
            )
        probs = scaled.softmax(dim=-1)
        # Exponential-race sampling: argmax(p / E) with E ~ Exp(1) draws from p, and lets each
        # seeded row use its own generator while unseeded rows share one draw.
        noise = exponential(probs.shape, probs.device, shared)
        for i, gen in enumerate(sb.generators):
            if gen is not None:
                noise[i] = exponential(probs.shape[1:], probs.device, gen)
        sampled = (probs / noise).argmax(dim=-1)
        ids = torch.where(temp > 0, sampled, greedy_ids)
    result = SampleResult(ids.cpu(), None, None, None)
    if sb.max_logprobs is not None:
        logp = raw.log_softmax(dim=-1)
        result.chosen_logprobs = logp.gather(1, ids[:, None]).squeeze(1).cpu()
        if sb.max_logprobs > 0:
            top = logp.topk(sb.max_logprobs, dim=-1)
            result.top_ids, result.top_logprobs = top.indices.cpu(), top.values.cpu()
    return result


def exponential(shape: torch.Size, device: torch.device, gen: torch.Generator) -> torch.Tensor:
    """Exp(1) draws as -log(U), U uniform on [0, 1): `torch.rand` is vectorised, whereas
    `exponential_` draws one double at a time on CPU (24 ms for 32 x 49152 on 2 cores, against
    4 ms; benchmarks/RESULTS.md "HTTP: TTFT and ITL"). U = 0 (2^-24 per draw) gives +inf, so
    that token cannot win that draw: a bias below 1e-7."""
    return torch.rand(shape, device=device, generator=gen).log_().neg_()


def _filter_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)
    drop = ranks >= k[:, None]
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    # Keep a token while the mass before it is < top_p, so the first token always survives.
    mass_before = probs.cumsum(dim=-1) - probs
    drop |= mass_before >= top_p[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)
