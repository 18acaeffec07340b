"""Exact merge of two partial attention results over disjoint key sets.

If `(o_a, lse_a)` is attention of some queries over keys A and `(o_b, lse_b)` over keys B
(A ∩ B = ∅), then attention over A ∪ B is

    lse = logaddexp(lse_a, lse_b)
    o   = o_a·exp(lse_a − lse) + o_b·exp(lse_b − lse)

Both weights lie in [0, 1] and sum to 1, so nothing overflows however large the scores are
(unlike `log(1 + exp(·))`). A row that saw no key on one side has lse = −inf there and weight
exactly 0; a row that saw no key on either side keeps lse = −inf and o = 0 (no NaN), which the
kernels' contract relies on.
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
    new = torch.logaddexp(lse, lse_blk)  # -inf only when both are -inf
    # Where both sides are empty, subtract 0 instead of -inf: exp(-inf - 0) = 0 for both
    # weights (and o stays 0), where exp(-inf - (-inf)) would be NaN.
    ref = torch.where(torch.isneginf(new), 0.0, new)
    w = torch.exp(lse - ref).transpose(1, 2).unsqueeze(-1)  # (B, N, H, 1)
    w_blk = torch.exp(lse_blk - ref).transpose(1, 2).unsqueeze(-1)
    o.mul_(w).addcmul_(o_blk, w_blk)
    lse.copy_(new)
