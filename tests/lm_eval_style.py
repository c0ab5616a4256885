"""lm-evaluation-harness's `local-completions` loglikelihood, as that client computes it, on a
small multiple-choice task built here (no dataset download), and the transformers reference.

The client (lm_eval/models/openai_completions.py, api_models.py): each (context, continuation)
pair is encoded as lm-eval's `_encode_pair` does (trailing spaces of the context move to the
continuation; the continuation's tokens are the whole text's beyond the context's), requests are
batched as lists of token ids with {temperature 0, max_tokens 1, logprobs 1, seed 1234, echo
true}, and a choice's loglikelihood is the sum of `token_logprobs[ctxlen:-1]` (the echoed
continuation, without the one generated token). `max_tokens: 0` (the prompt alone) is the other
spelling clients send; then the sum runs to the end."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer

# A small multiple-choice task: (context, choices). Choices share the context, so a prefix cache
# may hold it from an earlier choice.
TASK: list[tuple[str, list[str]]] = [
    ("the quick brown fox jumps over the", [" lazy dog", " quick fox", " world"]),
    ("hello world, key:", [" value", " hello", " the lazy dog."]),
    ("the lazy dog. hello", [" world", " fox jumps over the lazy dog"]),
    ("key: value key: value key:", [" value", " key"]),
]

Pair = tuple[list[int], list[int]]  # (context tokens, continuation tokens)


def encode_pairs(model_dir: Path, task: list[tuple[str, list[str]]] = TASK) -> list[Pair]:
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))

    def enc(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False).ids

    pairs = []
    for context, choices in task:
        for cont in choices:
            n_spaces = len(context) - len(context.rstrip())
            ctx, cnt = context, cont
            if n_spaces:
                cnt, ctx = context[-n_spaces:] + cont, context[:-n_spaces]
            whole, ctx_ids = enc(ctx + cnt), enc(ctx)
            pairs.append((ctx_ids, whole[len(ctx_ids) :]))
    return pairs


def payload(model: str, prompts: list[list[int]], max_tokens: int = 1) -> dict[str, Any]:
    return {
        "model": model,
        "prompt": prompts,
        "temperature": 0,
        "max_tokens": max_tokens,
        "logprobs": 1,
        "seed": 1234,
        "echo": True,
    }


def parse_logprobs(body: dict[str, Any], ctxlens: list[int], max_tokens: int = 1) -> list[float]:
    out = []
    choices = sorted(body["choices"], key=lambda c: c["index"])
    for choice, ctxlen in zip(choices, ctxlens, strict=True):
        assert ctxlen > 0
        lps = choice["logprobs"]["token_logprobs"]
        cont = lps[ctxlen:-1] if max_tokens else lps[ctxlen:]
        out.append(float(sum(cont)))
    return out


def loglikelihoods(
    post: Callable[[dict[str, Any]], dict[str, Any]],
    model: str,
    pairs: list[Pair],
    batch: int = 4,
    max_tokens: int = 1,
) -> list[float]:
    """Per-pair loglikelihoods through the HTTP API, in batches as the client sends them."""
    out: list[float] = []
    for i in range(0, len(pairs), batch):
        chunk = pairs[i : i + batch]
        body = post(payload(model, [c + x for c, x in chunk], max_tokens))
        out += parse_logprobs(body, [len(c) for c, _ in chunk], max_tokens)
    return out


def hf_loglikelihoods(model_dir: Path, pairs: list[Pair]) -> list[float]:
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for ctx, cont in pairs:
            ids = torch.tensor([ctx + cont])
            logp = model(ids).logits[0].float().log_softmax(-1)
            pos = torch.arange(len(ctx) - 1, len(ctx) + len(cont) - 1)
            out.append(float(logp[pos, torch.tensor(cont)].sum()))
    return out
