"""Shared fixtures: tiny random checkpoints (built once per session) and their HF references."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("KVFENCE_FAULT_INJECTION", "1")  # tests may arm fault points
torch.set_num_threads(min(2, os.cpu_count() or 1))

from checkpoints import build_checkpoint  # noqa: E402
from tls_certs import cluster_dir  # noqa: E402

# Worker processes the tests start find the cluster's certificates there (I8). Set, not
# defaulted: under pytest-xdist (`make test`) each test process inherits the controller's
# environment but makes (and must hand its children) a CA of its own.
os.environ["KVFENCE_TLS_DIR"] = str(cluster_dir())

REPO = Path(__file__).resolve().parent.parent
TINY_MODEL = REPO / "models" / "kvfence-tiny"


@pytest.fixture(scope="session")
def checkpoint_dir(tmp_path_factory: pytest.TempPathFactory):
    cache: dict[tuple[str, str], Path] = {}

    def get(arch: str, **overrides) -> Path:
        key = (arch, json.dumps(overrides, sort_keys=True))
        if key not in cache:
            out = tmp_path_factory.mktemp(f"{arch}-{len(cache)}")
            cache[key] = build_checkpoint(arch, out, **overrides)
        return cache[key]

    return get


def hf_greedy(model_dir: Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    for p in prompts:
        ids = model.generate(
            torch.tensor([p]),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
        out.append(ids[0, len(p) :].tolist())
    return out


def random_prompts(lengths: list[int], vocab: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab - 1, (n,), generator=g).tolist() for n in lengths]
