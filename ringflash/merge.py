"""Exact merge of two partial attention results over disjoint key sets.

If `(o_a, lse_a)` is attention of some queries over keys A and `(o_b, lse_b)` over keys B
(A ∩ B = ∅), then attention over A ∪ B is

    lse = logaddexp(lse_a, lse_b)
    o   = o_a·exp(lse_a − lse) + o_b·exp(lse_b − lse) = o_a·σ(−d) + o_b·σ(d),   d = lse_b − lse_a

The weights are computed as sigmoids of the difference d, not as exponentials of `lse_a − lse`:
the same value, but exact to float32 precision even where |lse| is large (at |lse| ≈ 1e4 the
rounding of the merged lse alone would put 5e-4 relative error into exp(lse_a − lse)). Both
weights lie in [0, 1], so nothing overflows (unlike `log(1 + exp(·))`), and `logaddexp` is the
stable max + log1p form. A row that saw no key on one side has lse = −inf there: d = ±inf, weight
exactly 0. A row that saw no key on either side (d = NaN) keeps lse = −inf and o = 0, never NaN,
which the kernels' contract relies on.
"""

from __future__ import annotations

import torch

__all__ = ["merge"]


@torch.no_grad()
def merge(o: torch.Tensor, lse: torch.Tensor, o_blk: torch.Tensor, lse_blk: torch.Tensor) -> None:
    """Merge the block result `(o_blk, lse_blk)` into the running `(o, lse)`, in place.

    o: `(B, N, H, D)` float32 accumulator (a view, e.g. some rows of a larger one, is fine).
    lse: `(B, H, N)` float32, natural log, updated in place.
    o_blk: `(B, N, H, D)` in any float dtype (the kernel's output dtype); math is in float32.
    lse_blk: `(B, H, N)` float32.
    """
    if o.dtype != torch.float32 or lse.dtype != torch.float32 or lse_blk.dtype != torch.float32:
        raise TypeError(f"merge accumulates in float32: got o {o.dtype}, lse {lse.dtype}, lse_blk {lse_blk.dtype}")
    if o.shape != o_blk.shape:
        raise ValueError(f"o_blk must have o's shape {tuple(o.shape)}, got {tuple(o_blk.shape)}")
    B, N, H, _ = o.shape
    if lse.shape != (B, H, N) or lse_blk.shape != (B, H, N):
        raise ValueError(
            f"lse and lse_blk must have shape (B, H, N) = {(B, H, N)}, "
            f"got {tuple(lse.shape)} and {tuple(lse_blk.shape)}"
        )
    new = torch.logaddexp(lse, lse_blk)  # -inf only where both are -inf
    d = lse_blk - lse
    # Both sides empty: d is NaN; any finite weight works because o and o_blk are 0 there.
    d = torch.where(torch.isnan(d), 0.0, d).transpose(1, 2).unsqueeze(-1)  # (B, N, H, 1)
    o.mul_(torch.sigmoid(-d)).addcmul_(o_blk, torch.sigmoid(d))
    lse.copy_(new)
