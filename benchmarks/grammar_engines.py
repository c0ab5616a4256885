"""The measurement behind the grammar-engine choice: JSON-schema compile time and warm per-token
mask + advance cost of llguidance, xgrammar and outlines-core on one CPU thread, walking one
valid answer token by token. Engines that are not installed are skipped (only llguidance is a
kvfence dependency; `pip install xgrammar outlines-core` into a scratch env for the others).

    .venv/bin/python benchmarks/grammar_engines.py DIR_WITH_TOKENIZER_JSON [EOS_TOKEN]
"""

from __future__ import annotations

import json
import sys
import time

import torch

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0},
        "tags": {"type": "array", "items": {"enum": ["a", "bb", "ccc"]}, "maxItems": 5},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "score": {"type": "number"},
    },
    "required": ["name", "age", "tags", "address", "score"],
    "additionalProperties": False,
}
ANSWER = (
    '{"name": "Ada Lovelace the first programmer", "age": 36, "tags": ["a", "ccc", "bb"], '
    '"address": {"city": "London town", "zip": "12345"}, "score": 3.25}'
)


def _walk(step, ids: list[int], reps: int = 3) -> float:
    """Warm per-token seconds (the last of reps passes over a fresh matcher)."""
    per = 0.0
    for _ in range(reps):
        fill, accept = step()
        t0 = time.perf_counter()
        for t in ids:
            fill()
            assert accept(t), t
        per = (time.perf_counter() - t0) / len(ids)
    return per


def main() -> None:
    from tokenizers import Tokenizer

    torch.set_num_threads(1)
    path = f"{sys.argv[1]}/tokenizer.json"
    tok = Tokenizer.from_file(path)
    vocab = tok.get_vocab_size(with_added_tokens=True)
    eos = tok.token_to_id(sys.argv[2] if len(sys.argv) > 2 else "<|eos|>") or 0
    ids = tok.encode(ANSWER, add_special_tokens=False).ids
    print(f"vocab {vocab}, answer {len(ids)} tokens")
    out = {}
    import llguidance

    lt = llguidance.LLTokenizer(tok.to_str(), n_vocab=vocab, eos_token=eos)
    opts = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
    t0 = time.perf_counter()
    m0 = llguidance.LLMatcher(lt, llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, opts))
    compile_s = time.perf_counter() - t0
    bm = torch.full((1, (vocab + 31) // 32), -1, dtype=torch.int32)

    def llg():
        m = m0.deep_copy()
        return (lambda: m.unsafe_compute_mask_ptr(bm.data_ptr(), bm.shape[1] * 4)), m.consume_token

    out["llguidance"] = (compile_s, _walk(llg, ids))
    try:
        import xgrammar as xgr
        from transformers import PreTrainedTokenizerFast

        hf = PreTrainedTokenizerFast(tokenizer_file=path)
        info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=[eos])
        comp = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        t0 = time.perf_counter()
        cg = comp.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
        compile_s = time.perf_counter() - t0
        xb = xgr.allocate_token_bitmask(1, vocab)

        def xg():
            m = xgr.GrammarMatcher(cg)
            return (lambda: m.fill_next_token_bitmask(xb)), m.accept_token

        out["xgrammar"] = (compile_s, _walk(xg, ids))
    except ImportError:
        print("xgrammar not installed: skipped")
    try:
        import outlines_core as oc

        out["outlines-core"] = _outlines(oc, tok, vocab, eos, ids)
    except ImportError:
        print("outlines-core not installed: skipped")
    for name, (c, per) in out.items():
        print(f"{name:14s} compile {c * 1e3:8.1f} ms   mask+advance {per * 1e6:8.1f} us/token")


def _outlines(oc, tok, vocab: int, eos: int, ids: list[int]) -> tuple[float, float]:
    bs = [*range(33, 127), *range(161, 173), *range(174, 256)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    u2b = {chr(c): b for b, c in zip(bs, cs, strict=True)}
    table: dict[bytes, list[int]] = {}
    for s, i in tok.get_vocab(with_added_tokens=False).items():
        if i != eos:
            key = bytes(u2b[ch] for ch in s) if all(ch in u2b for ch in s) else s.encode()
            table.setdefault(key, []).append(i)
    voc = oc.Vocabulary(eos, table)
    t0 = time.perf_counter()
    index = oc.Index(oc.json_schema.build_regex_from_schema(json.dumps(SCHEMA), r"[ ]?"), voc)
    compile_s = time.perf_counter() - t0
    ob = torch.zeros((1, (vocab + 31) // 32), dtype=torch.int32)

    def step():
        g = oc.Guide(index)
        fill = lambda: g.write_mask_into(ob.data_ptr(), ob.numel(), ob.element_size())  # noqa: E731
        return fill, lambda t: g.advance(t, return_tokens=False) is None or True

    return compile_s, _walk(step, ids)


if __name__ == "__main__":
    main()
