"""The grouped LoRA matmul: rows grouped by a key (an adapter slot, or a slot and an expert),
padded to the longest group, and each group's update computed by one batched matmul pair with
its own A and B; the updates come back in row order. No loop over rows or groups: the padding
costs at most (groups x longest group - rows) rows of rank-sized work."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Groups:
    keys: torch.Tensor  # [groups] the keys present, ascending: group g uses A[keys[g]], B[...]
    gather: torch.Tensor  # [groups * longest] the row of each padded row (padding: any row)
    # [rows] the padded row of each row's update, `groups * longest` (a zero row) for a row with
    # no key; None when the padded rows are the rows in order.
    spread: torch.Tensor | None
    zero_row: bool  # whether some row reads the zero row

    @property
    def size(self) -> int:
        return len(self.keys)


def group_rows(key: torch.Tensor, n_keys: int) -> Groups | None:
    """Rows by `key` (int64 [rows], -1: no update); None when no row has a key."""
    order = torch.argsort(key, stable=True)
    counts = torch.bincount(key + 1, minlength=n_keys + 1)
    none = int(counts[0])
    if none == len(key):
        return None
    rows = order[none:]
    present = torch.nonzero(counts[1:]).flatten()
    sizes = counts[1:][present]
    longest, groups, dev = int(sizes.max()), len(present), key.device
    # Row j of group g sits at padded row g * longest + j.
    group_of_row = torch.repeat_interleave(torch.arange(groups, device=dev), sizes)
    first = torch.cumsum(sizes, 0) - sizes
    padded_row = group_of_row * longest + torch.arange(len(rows), device=dev) - first[group_of_row]
    gather = rows[:1].repeat(groups * longest)
    gather[padded_row] = rows
    spread = torch.full((len(key),), groups * longest, dtype=torch.int64, device=dev)
    spread[rows] = padded_row
    identity = groups * longest == len(key) and bool(
        (spread == torch.arange(len(key), device=dev)).all()
    )
    return Groups(present, gather, None if identity else spread, none > 0)


def grouped_delta(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, g: Groups) -> torch.Tensor:
    """[rows, out]: row i's (x[i] @ a[group]) @ b[group], zero for a row with no key; `a` and `b`
    [groups, in, r] and [groups, r, out], in the order of g.keys."""
    xs = x.index_select(0, g.gather).view(g.size, -1, x.shape[1])
    t = torch.bmm(xs, a)
    padded, out = len(g.gather), b.shape[2]
    d = torch.empty(padded + g.zero_row, out, dtype=x.dtype, device=x.device)
    torch.bmm(t, b, out=d[:padded].view(g.size, -1, out))
    if g.zero_row:
        d[padded:].zero_()
    # A gather back into row order for a dense add: index_add_'s scatter wakes the CPU thread
    # pool per call, which dominated a loaded machine's profile of the mixed batch.
    return d if g.spread is None else d.index_select(0, g.spread)
