"""Held-out in-context recall evaluation of models/kvfence-tiny with Hugging Face transformers.

Owns the recall metric reported in the model card. Run: python scripts/eval_recall.py --help
"""

from __future__ import annotations

import argparse
import os
import random
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import recall_data  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = REPO / "models" / "kvfence-tiny"
EVAL_SEED = 7919


@dataclass
class RecallResult:
    n: int = 0
    hits: int = 0
    tokens: list[int] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    @property
    def rate(self) -> float:
        return self.hits / self.n if self.n else 0.0

    def summary(self) -> str:
        lo, hi = (min(self.tokens), max(self.tokens)) if self.tokens else (0, 0)
        return (
            f"{self.hits}/{self.n} = {100 * self.rate:.1f}% exact recall (prompts {lo}-{hi} tokens)"
        )


def load(path: Path, dtype: str) -> tuple[torch.nn.Module, object]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    model.eval()
    return model, tok


def token_counter(tok: object) -> Callable[[str], int]:
    def count(text: str) -> int:
        return len(tok(text, add_special_tokens=False)["input_ids"])

    return count


@torch.inference_mode()
def evaluate(
    model: torch.nn.Module,
    tok: object,
    maker: recall_data.PromptMaker,
    n: int,
    lo: int,
    hi: int,
    seed: int,
    verbose: bool = False,
) -> RecallResult:
    """Greedy-decode len(value tokens)+4 tokens after each prompt and score exact recall."""
    rng = random.Random(f"{seed}-{maker.style}-{lo}-{hi}")
    res = RecallResult()
    for i in range(n):
        item = maker.make(rng, lo, hi)
        ids = tok(item.text, return_tensors="pt")["input_ids"]  # adds BOS
        n_new = len(tok(" " + item.value, add_special_tokens=False)["input_ids"]) + 4
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n_new,
            do_sample=False,
            pad_token_id=tok.pad_token_id,
        )
        text = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=False)
        ok = recall_data.recalled(text, item.value)
        res.n += 1
        res.hits += ok
        res.tokens.append(ids.shape[1])
        if not ok:
            res.failures.append(
                f"{item.key!r}: want {item.value!r} got {text!r} ({ids.shape[1]} tok)"
            )
        if verbose:
            mark = "ok  " if ok else "MISS"
            print(f"  {i:3d} {ids.shape[1]:5d} tok {mark} {item.value!r} -> {text!r}")
    return res


def _block_re(tag: str) -> re.Pattern[str]:
    return re.compile(
        rf"<!-- eval:{re.escape(tag)}:begin -->\n(.*?)\n<!-- eval:{re.escape(tag)}:end -->", re.S
    )


def card_blocks(card_text: str) -> dict[str, str]:
    """The filled-in evaluation blocks of a model card, by tag."""
    found = re.findall(
        r"<!-- eval:([\w.-]+):begin -->\n(.*?)\n<!-- eval:\1:end -->", card_text, re.S
    )
    return {tag: body for tag, body in found if not body.startswith("(not measured")}


def replace_block(card_text: str, tag: str, block: str) -> str:
    pattern = _block_re(tag)
    if not pattern.search(card_text):
        raise SystemExit(f"model card has no eval:{tag} section")
    begin, end = f"<!-- eval:{tag}:begin -->", f"<!-- eval:{tag}:end -->"
    return pattern.sub(lambda _: f"{begin}\n{block}\n{end}", card_text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    ap.add_argument("--n-short", type=int, default=200, help="prompts of 200-1500 tokens")
    ap.add_argument("--n-long", type=int, default=100, help="prompts of 1500-4000 tokens")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--seed", type=int, default=EVAL_SEED)
    ap.add_argument("--style", default="heldout", choices=["heldout", "recipe"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--verbose", action="store_true")
    ap.add_argument(
        "--update-card", action="store_true", help="write the figures into the model card"
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    model, tok = load(args.model, args.dtype)
    maker = recall_data.PromptMaker(args.style, token_counter(tok))
    lines = []
    for name, n, lo, hi in (("short", args.n_short, 200, 1500), ("long", args.n_long, 1500, 4000)):
        if not n:
            continue
        t0 = time.time()
        res = evaluate(model, tok, maker, n, lo, hi, args.seed, args.verbose)
        line = f"{args.style} {name} ({lo}-{hi} tokens), {args.dtype}: {res.summary()}"
        print(f"{line} [{time.time() - t0:.0f}s]", flush=True)
        for fail in res.failures[:10]:
            print("  miss:", fail)
        lines.append(f"- {line}")
    if args.update_card:
        cmd = " ".join(["python scripts/eval_recall.py", *sys.argv[1:]]).replace(
            " --update-card", ""
        )
        card = args.model / "README.md"
        block = f"`{cmd}` (seed {args.seed}, torch {torch.__version__}):\n\n" + "\n".join(lines)
        card.write_text(replace_block(card.read_text(), f"{args.style}-{args.dtype}", block))


if __name__ == "__main__":
    main()
