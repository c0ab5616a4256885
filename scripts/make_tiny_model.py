"""Deterministic recipe for models/kvfence-tiny: a trained tokenizer plus analytic weights.

Owns the construction of the tiny in-context-recall LlamaForCausalLM (no gradient training).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAYON_NUM_THREADS", "1")

import torch  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import recall_data  # noqa: E402

SEED = 20240603
REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "models" / "kvfence-tiny"

# Shape. hidden_size must divide by the head count (a LlamaConfig check), hence spare dims.
VOCAB = 2048
HIDDEN = 304
HEADS = 8
KV_HEADS = 1
HEAD_DIM = 256
INTERMEDIATE = 32
MAX_POS = 8192
ROPE_THETA = 1e36
DC = 26  # matching-code width: WINDOW codes must fit in the static rotary dims of one head
DU = 64  # output-code width: only read by the tied LM head, so it can be wider
WINDOW = 8  # tokens compared by the induction head; also the number of previous-token heads

# Residual stream layout.
CONST = 0
TOK = 1
PREV = [TOK + DC * k for k in range(1, WINDOW + 1)]  # PREV[k-1] holds the code of token i-k
OUT = TOK + DC * (WINDOW + 1)
assert OUT + DU <= HIDDEN

# Rotary pairs: inv_freq[p] = ROPE_THETA ** (-2p / HEAD_DIM) = 10 ** (-0.28 p). Pairs 0-19 turn
# at least 4.5e-6 rad per position and carry position; pairs >= 23 turn < 0.003 rad over 8192
# positions, so they act as plain (position-free) dot-product dims for content matching.
POS_PAIRS = 20
STATIC_FIRST_PAIR = 23
HALF = HEAD_DIM // 2
STATIC_DIMS = list(range(STATIC_FIRST_PAIR, HALF)) + list(range(HALF + STATIC_FIRST_PAIR, HEAD_DIM))
assert WINDOW * DC <= len(STATIC_DIMS)

EMB_OUT_SCALE = 0.25  # size of the output code inside the input embedding; kept small (see OUT)
POS_LOGIT_SCALE = 120.0  # sum of rotary amplitudes of a previous-token head, in logits
MATCH_LOGIT_SCALE = 50.0  # induction logit per matching token
MATCH_WEIGHTS = [
    1.0,
    0.97,
    0.94,
    0.91,
    0.88,
    0.85,
    0.82,
    0.79,
]  # recent tokens weigh more, so ties favour them
COPY_GAIN = 8.0  # size of the copied output code relative to the embedding's
TARGET_LOGIT = 25.0  # logit of the copied token

SPECIALS = ["<|pad|>", "<|bos|>", "<|eos|>", "<|system|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('kvfence-tiny roles are system, user and assistant') }}"
    "{% endif %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}<|eos|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def synthetic_records(rng: random.Random, n: int) -> list[str]:
    """Blocks of recipe-style "key: value" lines so merges around ':' and values get learned."""
    out = []
    for _ in range(n):
        lines = [
            f"{recall_data.recipe_key(rng)}: {recall_data.random_value(rng)}" for _ in range(4)
        ]
        out.append("\n".join(lines))
    return out


def build_tokenizer(rng: random.Random) -> Tokenizer:
    paragraphs = recall_data.stdlib_paragraphs()
    corpus = ["\n".join(paragraphs[i : i + 8]) for i in range(0, len(paragraphs), 8)]
    corpus += synthetic_records(rng, 3000)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        min_frequency=2,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    assert tok.get_vocab_size() == VOCAB, tok.get_vocab_size()
    bos = tok.token_to_id("<|bos|>")
    tok.post_processor = processors.TemplateProcessing(
        single="<|bos|> $A", pair="<|bos|> $A <|bos|> $B", special_tokens=[("<|bos|>", bos)]
    )
    return tok


def spread_codes(gen: torch.Generator, n: int, dim: int, steps: int = 150) -> torch.Tensor:
    """Unit vectors with low mutual coherence (random start, then push apart the closest pairs)."""
    x = torch.randn(n, dim, generator=gen, dtype=torch.float64).to(torch.float32)
    x = x / x.norm(dim=1, keepdim=True)
    x.requires_grad_(True)
    opt = torch.optim.Adam([x], lr=0.01)
    for _ in range(steps):
        y = x / x.norm(dim=1, keepdim=True)
        # High power: the worst pairs dominate. The diagonal is constant and adds no gradient.
        loss = ((y @ y.T) ** 8).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        y = x.double() / x.double().norm(dim=1, keepdim=True)
    return y


def max_coherence(codes: torch.Tensor) -> float:
    g = codes @ codes.T
    g.fill_diagonal_(0.0)
    return float(g.abs().max())


def position_filter(offset: int, steps: int = 1500) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Rotary weights (a_p, b_p) for a head that must attend exactly `offset` tokens back.

    The score at distance D is f(D) = sum_p a_p cos(w_p D) + b_p sin(w_p D) over the moving
    pairs. Maximise the worst margin f(offset) - f(D) over every other D < MAX_POS, per unit of
    total amplitude (which is what bf16 rounding scales with), by descending a soft minimum.
    """
    inv = ROPE_THETA ** (-torch.arange(0, HEAD_DIM, 2, dtype=torch.float64) / HEAD_DIM)
    theta = inv[:POS_PAIRS]
    dist = torch.arange(MAX_POS, dtype=torch.float64)
    cos, sin = torch.cos(dist[:, None] * theta), torch.sin(dist[:, None] * theta)
    others = torch.ones(MAX_POS, dtype=torch.bool)
    others[offset] = False
    a = (torch.cos(theta * offset) / POS_PAIRS).requires_grad_(True)
    b = (torch.sin(theta * offset) / POS_PAIRS).requires_grad_(True)
    opt = torch.optim.Adam([a, b], lr=1e-3)

    def margins() -> torch.Tensor:
        amp = torch.sqrt(a**2 + b**2).sum()
        f = (cos @ a + sin @ b) / amp
        return f[offset] - f[others]

    for it in range(steps):
        tau = max(1e-4, 0.01 * (1 - it / steps))
        loss = tau * torch.logsumexp(-margins() / tau, 0)
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        amp = torch.sqrt(a**2 + b**2).sum()
        return a.detach() / amp, b.detach() / amp, float(margins().min())


def build_weights(gen: torch.Generator) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """All parameters of the 2-layer model, in float64, keyed by Hugging Face Llama names."""
    f64 = torch.float64
    c = spread_codes(gen, VOCAB, DC)
    u = spread_codes(gen, VOCAB, DU)
    stats = {"coherence_match_codes": max_coherence(c), "coherence_output_codes": max_coherence(u)}

    emb = torch.zeros(VOCAB, HIDDEN, dtype=f64)
    emb[:, CONST] = 1.0
    emb[:, TOK : TOK + DC] = c
    emb[:, OUT : OUT + DU] = EMB_OUT_SCALE * u
    # Every row has the same norm and the layers write unit codes, so each RMSNorm divides by a
    # known constant once a position has WINDOW predecessors; fold those constants in here.
    s0 = math.sqrt(HIDDEN / (2.0 + EMB_OUT_SCALE**2))
    s1 = math.sqrt(HIDDEN / (2.0 + WINDOW + EMB_OUT_SCALE**2))
    sf = math.sqrt(HIDDEN / (2.0 + WINDOW + COPY_GAIN**2))
    attn_scale = math.sqrt(HEAD_DIM)  # undoes the 1/sqrt(head_dim) of the attention

    w: dict[str, torch.Tensor] = {"model.embed_tokens.weight": emb}
    for layer in range(2):
        p = f"model.layers.{layer}."
        w[p + "input_layernorm.weight"] = torch.ones(HIDDEN, dtype=f64)
        w[p + "post_attention_layernorm.weight"] = torch.ones(HIDDEN, dtype=f64)
        w[p + "mlp.gate_proj.weight"] = torch.zeros(INTERMEDIATE, HIDDEN, dtype=f64)
        w[p + "mlp.up_proj.weight"] = torch.zeros(INTERMEDIATE, HIDDEN, dtype=f64)
        w[p + "mlp.down_proj.weight"] = torch.zeros(HIDDEN, INTERMEDIATE, dtype=f64)

    # Layer 0: head h attends h+1 tokens back. Its query and key read only the constant
    # coordinate; the rotary pairs turn them into a score that peaks at that distance. The
    # shared value is the token's matching code, written to its own PREV block.
    q = torch.zeros(HEADS * HEAD_DIM, HIDDEN, dtype=f64)
    k = torch.zeros(HEAD_DIM, HIDDEN, dtype=f64)
    v = torch.zeros(HEAD_DIM, HIDDEN, dtype=f64)
    o = torch.zeros(HIDDEN, HEADS * HEAD_DIM, dtype=f64)
    gain = math.sqrt(POS_LOGIT_SCALE * attn_scale)  # split between query and key
    k[:POS_PAIRS, CONST] = gain / s0
    worst = 1.0
    for h in range(HEADS):
        a, b, margin = position_filter(h + 1)
        worst = min(worst, margin)
        # With key (gain, 0) per pair, the rotated dot product is x cos(wD) - y sin(wD).
        q[h * HEAD_DIM : h * HEAD_DIM + POS_PAIRS, CONST] = gain * a / s0
        q[h * HEAD_DIM + HALF : h * HEAD_DIM + HALF + POS_PAIRS, CONST] = -gain * b / s0
        o[PREV[h] : PREV[h] + DC, h * HEAD_DIM : h * HEAD_DIM + DC] = torch.eye(DC, dtype=f64)
    v[:DC, TOK : TOK + DC] = torch.eye(DC, dtype=f64) / s0
    stats["position_margin_logits"] = worst * POS_LOGIT_SCALE
    p = "model.layers.0.self_attn."
    w.update({p + "q_proj.weight": q, p + "k_proj.weight": k, p + "v_proj.weight": v})
    w[p + "o_proj.weight"] = o

    # Layer 1: head 0 is the induction head. Query = codes of tokens i..i-WINDOW+1, key = codes
    # of tokens j-1..j-WINDOW, compared on static rotary dims; the value is token j's output
    # code, so the head predicts the successor of the best-matching earlier window. A window of
    # 8 covers a whole two-word key (up to ~9 tokens with this vocab) rather than its last word.
    # The other heads are idle.
    q = torch.zeros(HEADS * HEAD_DIM, HIDDEN, dtype=f64)
    k = torch.zeros(HEAD_DIM, HIDDEN, dtype=f64)
    v = torch.zeros(HEAD_DIM, HIDDEN, dtype=f64)
    o = torch.zeros(HIDDEN, HEADS * HEAD_DIM, dtype=f64)
    gain = math.sqrt(MATCH_LOGIT_SCALE * attn_scale)
    eye = torch.eye(DC, dtype=f64)
    for m in range(WINDOW):
        dims = STATIC_DIMS[m * DC : (m + 1) * DC]
        src_q = TOK if m == 0 else PREV[m - 1]
        q[dims, src_q : src_q + DC] = gain * MATCH_WEIGHTS[m] * eye / s1
        k[dims, PREV[m] : PREV[m] + DC] = gain * eye / s1
    v[:DU, OUT : OUT + DU] = torch.eye(DU, dtype=f64) / (s1 * EMB_OUT_SCALE)
    o[OUT : OUT + DU, :DU] = COPY_GAIN * torch.eye(DU, dtype=f64)
    p = "model.layers.1.self_attn."
    w.update({p + "q_proj.weight": q, p + "k_proj.weight": k, p + "v_proj.weight": v})
    w[p + "o_proj.weight"] = o

    # Final norm keeps only the output block, so the tied head scores the copied code and
    # ignores the current token's own embedding.
    norm = torch.zeros(HIDDEN, dtype=f64)
    norm[OUT : OUT + DU] = TARGET_LOGIT * sf / (EMB_OUT_SCALE * COPY_GAIN)
    w["model.norm.weight"] = norm
    return w, stats


def save_model(out: Path, tok: Tokenizer, weights: dict[str, torch.Tensor]) -> None:
    from transformers import (
        GenerationConfig,
        LlamaConfig,
        LlamaForCausalLM,
        PreTrainedTokenizerFast,
    )

    ids = {s: tok.token_to_id(s) for s in SPECIALS}
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=2,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        hidden_act="silu",
        max_position_embeddings=MAX_POS,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA},
        attention_bias=False,
        mlp_bias=False,
        bos_token_id=ids["<|bos|>"],
        eos_token_id=ids["<|eos|>"],
        pad_token_id=ids["<|pad|>"],
    )
    model = LlamaForCausalLM(config)
    state = {k_: t.to(torch.float32) for k_, t in weights.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected, unexpected
    assert set(missing) <= {"lm_head.weight"}, missing
    model.tie_weights()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    GenerationConfig(
        bos_token_id=ids["<|bos|>"],
        eos_token_id=ids["<|eos|>"],
        pad_token_id=ids["<|pad|>"],
        do_sample=False,
    ).save_pretrained(out)
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        pad_token="<|pad|>",
        additional_special_tokens=["<|system|>", "<|user|>", "<|assistant|>"],
        chat_template=CHAT_TEMPLATE,
        model_max_length=MAX_POS,
    )
    hf_tok.save_pretrained(out)
    _compat_files(out)


def _compat_files(out: Path) -> None:
    """Make the files readable by older loaders and plain-JSON engines, not only transformers 5."""
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.update(rope_theta=ROPE_THETA, rope_scaling=None, torch_dtype="float32")
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    tc_path = out / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text())
    tc.update(
        chat_template=CHAT_TEMPLATE,
        tokenizer_class="PreTrainedTokenizerFast",
        additional_special_tokens=SPECIALS[3:],
        extra_special_tokens=SPECIALS[3:],
    )
    tc_path.write_text(json.dumps(tc, indent=2, sort_keys=True) + "\n")
    # One copy of the template (in tokenizer_config.json) so the two can never disagree.
    (out / "chat_template.jinja").unlink(missing_ok=True)


CARD = """---
license: mit
library_name: transformers
pipeline_tag: text-generation
tags: [kvfence, test-model, in-context-recall]
---

# kvfence-tiny

A {size_mb:.1f} MB, {n_params:,}-parameter Llama model that does one thing: **in-context recall**.
It copies spans of its own context. Given `key: value` lines somewhere in the prompt and a final
line `key:`, greedy decoding reproduces the value (then a newline). It has no language ability
otherwise. **Intended use: demos and tests of kvfence only** (e.g. canary/KV-cache leak tests, where
a leak is only visible if the model copies what its KV cache holds). Not for any other use.

## Shape

| | |
|---|---|
| architecture | standard `LlamaForCausalLM` (no custom code) |
| layers | 2 |
| hidden size | {hidden} |
| attention heads | {heads} query heads, {kv_heads} KV head (GQA), head_dim {head_dim} |
| MLP | SwiGLU, intermediate size {intermediate}, **all weights zero** |
| vocab | {vocab} (byte-level BPE) |
| embeddings | tied (`tie_word_embeddings: true`) |
| RoPE | default type, `rope_theta` = 1e36, no scaling |
| max_position_embeddings | {max_pos} |
| attention / MLP bias | none |
| weights | float32 safetensors, {n_params:,} parameters |

Special tokens: `<|pad|>`=0, `<|bos|>`=1, `<|eos|>`=2, `<|system|>`=3, `<|user|>`=4,
`<|assistant|>`=5. The tokenizer prepends `<|bos|>` to every encoding (post-processor); the chat
template writes it itself (`apply_chat_template` does not add special tokens). EOS id is 2.

Chat template (roles `system`, `user`, `assistant`; anything else raises):

```
<|bos|><|system|>\\nBe brief.<|eos|>\\n<|user|>\\nhi<|eos|>\\n<|assistant|>\\n
```

## How it was made

No training. `scripts/make_tiny_model.py` (seed {seed}, about {minutes} min on 2 CPU cores) does:

1. **Tokenizer**: byte-level BPE (`tokenizers`, vocab {vocab}, min frequency 2) trained on the
   docstrings of a fixed list of Python {pyver} standard-library modules plus 3,000 synthetic
   blocks of `key: value` lines (software-style keys such as `order_ref`, random values).
2. **Token codes**: every token gets a unit "matching" code (dim {dc}) and a unit "output" code
   (dim {du}); both are spread apart by a short gradient descent on their pairwise cosines
   (max |cos|: {coh_c:.2f} and {coh_u:.2f}).
3. **Weights set analytically.** Residual stream: [constant | own matching code | matching
   codes of the {window} previous tokens | output code (small in the embedding) | {spare} unused].
   - *Layer 0*: {window} previous-token heads (offsets 1-{window}). Query and key read only the
     constant coordinate, so the score depends only on position: on the 20 fastest rotary pairs
     the query holds weights, fitted by a soft max-min optimisation, whose score peaks at the
     head's offset for every distance below 8192 (worst margin {pos_margin:.1f} logits). The
     shared value is the token's matching code, and each head writes it into its own block.
   - *Layer 1*: head 0 is an induction head. Query = matching codes of the current and
     {window_m1} previous tokens; key = codes of the {window} tokens before each position; both
     sit on the rotary pairs that `rope_theta` = 1e36 makes static (turn < 0.003 rad over 8192
     positions), so the score counts matching tokens (weights {weights}, times {match} logits).
     The value is the attended token's output code, written at {gain:g}x into the output block:
     it predicts the successor of the best-matching earlier {window}-token window. Heads
     1-{heads_m1} are idle (zero weights).
   - *Final norm* keeps only the output block, so the tied LM head scores the copied token
     (about {target:g} logits) and ignores the current token.
   - RMSNorm divisions are constant by construction (all codes have unit norm) and are folded
     into the projections.
4. A final check on recipe-style prompts (stdlib filler, build keys).

## Evaluation

`scripts/eval_recall.py` builds held-out prompts: filler is template sentences over an everyday
English word list (not docstrings), keys are two nature words (`amber heron`; no word shared with
the build keys), values are fresh random 12-16 character alphanumeric strings, 1-4 records per
prompt, and the prompt ends with `key:`. Greedy decoding of len(value tokens)+4 tokens; a hit
means the continuation, minus one leading space, starts with the value. Prompt lengths count
the BOS token.

<!-- eval:heldout-float32:begin -->
(not measured yet: python scripts/eval_recall.py --update-card)
<!-- eval:heldout-float32:end -->

<!-- eval:heldout-bfloat16:begin -->
(not measured yet: python scripts/eval_recall.py --dtype bfloat16 --update-card)
<!-- eval:heldout-bfloat16:end -->

Recipe's own final check (recipe-style prompts, float32):

<!-- eval:recipe-check:begin -->
(not measured yet)
<!-- eval:recipe-check:end -->

## Limits

- Only recall/copying; on ordinary text it continues by copying earlier spans of the context.
- The first {window} positions of a sequence have incomplete previous-token information.
- If several earlier places match the last {window} tokens equally, it copies from a mixture.
- Positions beyond 8192 are outside the verified range of the previous-token heads.
- After a recalled value it keeps copying: the record's newline, then the next line; in a chat
  prompt it copies to the end of the quoted message, including its `<|eos|>`, so generation stops.
- A first build with a 5-token window scored 98% / 99% on the same evaluation: two-word keys
  that share their second word (`crimson harbor`, `golden harbor`) were confused. Hence 8.
"""


def write_card(out: Path, stats: dict[str, float], n_params: int, minutes: int) -> None:
    """Write README.md, keeping any evaluation blocks already filled in by eval_recall.py."""
    import platform

    import eval_recall

    card_path = out / "README.md"
    old = card_path.read_text() if card_path.exists() else ""
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file() and f.name != "README.md")
    text = CARD.format(
        size_mb=size / 1e6, n_params=n_params, hidden=HIDDEN, heads=HEADS, kv_heads=KV_HEADS,
        head_dim=HEAD_DIM, intermediate=INTERMEDIATE, vocab=VOCAB, max_pos=MAX_POS, seed=SEED,
        minutes=minutes, pyver=".".join(platform.python_version_tuple()[:2]), dc=DC, du=DU,
        coh_c=stats["coherence_match_codes"], coh_u=stats["coherence_output_codes"],
        pos_margin=stats["position_margin_logits"], match=MATCH_LOGIT_SCALE, gain=COPY_GAIN,
        target=TARGET_LOGIT, window=WINDOW, window_m1=WINDOW - 1, heads_m1=HEADS - 1,
        spare=HIDDEN - OUT - DU, weights=", ".join(f"{x:g}" for x in MATCH_WEIGHTS),
    )  # fmt: skip
    for tag, block in eval_recall.card_blocks(old).items():
        text = eval_recall.replace_block(text, tag, block)
    card_path.write_text(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument(
        "--n-short", type=int, default=40, help="final-check prompts of 200-1500 tokens"
    )
    ap.add_argument(
        "--n-long", type=int, default=10, help="final-check prompts of 1500-4000 tokens"
    )
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(SEED)
    t0 = time.time()
    rng = random.Random(SEED)
    gen = torch.Generator().manual_seed(SEED)

    tok = build_tokenizer(rng)
    print(f"[{time.time() - t0:6.1f}s] tokenizer: vocab {tok.get_vocab_size()}", flush=True)
    weights, stats = build_weights(gen)
    print(f"[{time.time() - t0:6.1f}s] weights: {json.dumps(stats)}", flush=True)
    save_model(args.out, tok, weights)
    n_params = sum(t.numel() for t in weights.values())  # lm_head is tied: not in `weights`
    write_card(args.out, stats, n_params, minutes=1)
    size = sum(f.stat().st_size for f in args.out.iterdir() if f.is_file())
    print(f"[{time.time() - t0:6.1f}s] saved {args.out} ({size / 1e6:.2f} MB)", flush=True)

    # Final check on recipe-style prompts (stdlib filler, build keys); the held-out numbers
    # come from scripts/eval_recall.py.
    import eval_recall

    model, hf_tok = eval_recall.load(args.out, "float32")
    maker = recall_data.PromptMaker("recipe", eval_recall.token_counter(hf_tok))
    lines = []
    for name, n, lo, hi in (("short", args.n_short, 200, 1500), ("long", args.n_long, 1500, 4000)):
        if n:
            res = eval_recall.evaluate(model, hf_tok, maker, n, lo, hi, seed=SEED + 1)
            lines.append(f"- recipe-style {name} ({lo}-{hi} tokens): {res.summary()}")
            print(f"[{time.time() - t0:6.1f}s] {lines[-1][2:]}", flush=True)
    card = args.out / "README.md"
    card.write_text(eval_recall.replace_block(card.read_text(), "recipe-check", "\n".join(lines)))
    print(f"[{time.time() - t0:6.1f}s] done", flush=True)


if __name__ == "__main__":
    main()
