"""The grouped LoRA matmul (kvfence/lora/grouped.py) against a per-row reference: rows of several
keys in any order, rows with none, groups of unequal size (padding), and the in-order case."""

from __future__ import annotations

import torch

from kvfence.lora.grouped import group_rows, grouped_delta


def per_row(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(len(x), b.shape[2], dtype=torch.float64)
    for i, k in enumerate(key.tolist()):
        if k >= 0:
            out[i] = (x[i].double() @ a[k].double()) @ b[k].double()
    return out


def check(key: list[int], n_keys: int = 4) -> None:
    g = torch.Generator().manual_seed(len(key))
    x = torch.randn(len(key), 6, generator=g)
    a, b = torch.randn(n_keys, 6, 3, generator=g), torch.randn(n_keys, 3, 5, generator=g)
    k = torch.tensor(key)
    groups = group_rows(k, n_keys)
    assert groups is not None
    got = grouped_delta(x, a.index_select(0, groups.keys), b.index_select(0, groups.keys), groups)
    torch.testing.assert_close(got.double(), per_row(x, a, b, k), rtol=1e-5, atol=1e-5)


def test_grouped_delta_is_the_per_row_update() -> None:
    check([2, -1, 0, 2, 2, -1, 3, 0])  # interleaved, unequal groups, rows with no adapter
    check([1, 3, 1, 3])  # equal groups, every row adapted, out of order
    check([0, 0, 1, 1, 3])  # in order but padded
    check([3])


def test_rows_in_key_order_need_no_gather_back() -> None:
    g = group_rows(torch.tensor([0, 0, 1, 1]), 4)
    assert g is not None and g.spread is None and not g.zero_row
    assert g.keys.tolist() == [0, 1]
    check([0, 0, 1, 1])


def test_no_adapted_row_is_no_group() -> None:
    assert group_rows(torch.tensor([-1, -1]), 4) is None
