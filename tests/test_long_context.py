"""A prefill chunk's working set does not grow with the context behind it (issue 44): on the
native CPU backend the model's forward of a 32-token chunk allocates exactly the same tensors
behind 32 cached tokens as behind 1,984, so a long prompt prefills in chunks whose memory is
bounded by the chunk, and preflight's activation reserve (sized by the chunk, never the context)
holds for it. The reference backend's gathered context and [Lq, Lk] mask show what growth looks
like to the same count, so the count is not blind to it. Counted at torch's dispatcher, no
timing; benchmarks/prefill_attention.py measures the resident peak at 4k and 32k tokens."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from checkpoints import build_checkpoint

sys.path.append(str(Path(__file__).resolve().parent.parent))
from benchmarks import prefill_attention as bench  # noqa: E402

CHUNK = 32
CONTEXT = 2048


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(
        "llama", tmp_path_factory.mktemp("longctx"), max_position_embeddings=CONTEXT
    )


def allocations(checkpoint: Path, backend: str) -> list[bench.Allocations]:
    runner = bench.runner_for(checkpoint, CONTEXT, backend, chunk=CHUNK)
    return [bench.forward_allocations(runner, start, CHUNK) for start in (CHUNK, CONTEXT - CHUNK)]


def test_native_prefill_chunk_allocates_the_same_behind_any_context(checkpoint: Path) -> None:
    near, far = allocations(checkpoint, "native")
    assert (far.total, far.largest) == (near.total, near.largest), (
        f"a chunk behind {CONTEXT - CHUNK} cached tokens allocated {far.total} bytes (largest "
        f"{far.largest}) against {near.total} (largest {near.largest}) behind {CHUNK}: something "
        "per layer now grows with the context"
    )


def test_reference_gather_allocations_grow_with_the_context(checkpoint: Path) -> None:
    near, far = allocations(checkpoint, "torch")
    # Each layer gathers the context's K and V (2 x ctx x kv_heads x head_dim floats) and builds
    # a [chunk, ctx] mask: the count must see at least the gathered copies.
    layers, kv_row = 2, 2 * 16 * 4
    grown = (CONTEXT - 2 * CHUNK) * kv_row * 2 * layers
    assert far.total - near.total >= grown, (far.total, near.total)
