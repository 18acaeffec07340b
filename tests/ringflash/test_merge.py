"""ringflash.merge: the float32 (o, lse) merge against float64 attention over the union of keys."""

import math

import pytest
import torch

from ringflash.merge import merge

INF = float("inf")


def _attn64(q, k, v, mask=None):
    """float64 attention of q (B, Nq, H, D) over k, v (B, Nk, H, D): o (B, Nq, H, D), lse (B, H, Nq)."""
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double()) / math.sqrt(q.shape[-1])
    if mask is not None:
        s = s.masked_fill(~mask, -INF)
    lse = torch.logsumexp(s, -1)
    p = torch.where(torch.isfinite(lse)[..., None], torch.exp(s - lse.nan_to_num(neginf=0)[..., None]), 0.0)
    return torch.einsum("bhqk,bkhd->bqhd", p, v.double()), lse


@pytest.mark.parametrize("blk_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("splits", [2, 3])
def test_merge_equals_attention_over_union(splits, blk_dtype):
    # Keys cut into `splits` disjoint parts; merging the parts in float32 gives float64 attention
    # over all keys. Scores are scaled up so that the parts' lse differ by tens of nats.
    torch.manual_seed(0)
    B, Nq, Nk, H, D = 2, 7, 24, 3, 16
    q, k, v = torch.randn(B, Nq, H, D) * 3, torch.randn(B, Nk, H, D) * 3, torch.randn(B, Nk, H, D)
    o_ref, lse_ref = _attn64(q, k, v)
    o = lse = None
    for part in torch.arange(Nk).chunk(splits):
        o_blk, lse_blk = _attn64(q, k[:, part], v[:, part])
        o_blk, lse_blk = o_blk.to(blk_dtype), lse_blk.float()
        if o is None:
            o, lse = o_blk.float(), lse_blk
        else:
            merge(o, lse, o_blk, lse_blk)
    atol = 1e-5 if blk_dtype == torch.float32 else 2e-2  # bf16 rounding of the parts' o
    torch.testing.assert_close(o.double(), o_ref, atol=atol, rtol=0)
    torch.testing.assert_close(lse.double(), lse_ref, atol=1e-5, rtol=1e-6)


def test_both_sides_empty_stays_empty():
    # Rows that saw no key on either side: lse stays -inf and o stays 0, never NaN.
    o, lse = torch.zeros(1, 3, 2, 4), torch.full((1, 2, 3), -INF)
    merge(o, lse, torch.zeros(1, 3, 2, 4), torch.full((1, 2, 3), -INF))
    assert torch.isneginf(lse).all()
    assert (o == 0).all()


@pytest.mark.parametrize("empty_side", ["acc", "blk"])
def test_one_side_empty_takes_the_other(empty_side):
    torch.manual_seed(1)
    o_full, lse_full = torch.randn(2, 5, 3, 8), torch.randn(2, 3, 5) * 10
    o_none, lse_none = torch.zeros(2, 5, 3, 8), torch.full((2, 3, 5), -INF)
    if empty_side == "acc":
        o, lse = o_none.clone(), lse_none.clone()
        merge(o, lse, o_full, lse_full)
    else:
        o, lse = o_full.clone(), lse_full.clone()
        merge(o, lse, o_none, lse_none)
    torch.testing.assert_close(o, o_full, atol=0, rtol=0)
    torch.testing.assert_close(lse, lse_full, atol=0, rtol=0)


@pytest.mark.parametrize(("a", "b"), [(1e4, 1e4 - 3.0), (-1e4, 5.0), (88.0, 89.0), (3e38, 3e38)])
def test_large_magnitudes_do_not_overflow(a, b):
    # exp(lse) overflows float32 beyond ~88.7; the merge only ever exponentiates differences.
    o, lse = torch.full((1, 1, 1, 2), 1.0), torch.full((1, 1, 1), a)
    o_blk, lse_blk = torch.full((1, 1, 1, 2), -1.0), torch.full((1, 1, 1), b)
    merge(o, lse, o_blk, lse_blk)
    a64, b64 = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
    new = torch.logaddexp(a64, b64)
    expect_o = torch.exp(a64 - new) - torch.exp(b64 - new)
    assert torch.isfinite(o).all() and torch.isfinite(lse).all()
    torch.testing.assert_close(o, torch.full_like(o, expect_o.item()), atol=1e-6, rtol=0)
    torch.testing.assert_close(lse.double(), new.expand(1, 1, 1), rtol=1e-6, atol=0)


def test_mixed_rows_and_partial_views():
    # Some rows empty on one side, some on both, merged through a view of a larger accumulator
    # (the ring merges a query slice in place).
    torch.manual_seed(2)
    B, N, H, D = 1, 6, 2, 4
    o_acc, lse_acc = torch.randn(B, 2 * N, H, D), torch.randn(B, H, 2 * N)
    lse_acc[:, :, N : N + 2] = -INF
    o_acc[:, N : N + 2] = 0
    o_blk, lse_blk = torch.randn(B, N, H, D), torch.randn(B, H, N)
    lse_blk[:, :, 1:3] = -INF
    o_blk[:, 1:3] = 0
    before_o, before_lse = o_acc.clone(), lse_acc.clone()
    merge(o_acc[:, N:], lse_acc[:, :, N:], o_blk, lse_blk)
    torch.testing.assert_close(o_acc[:, :N], before_o[:, :N], atol=0, rtol=0)  # untouched rows
    new = torch.logaddexp(before_lse[:, :, N:], lse_blk)
    torch.testing.assert_close(lse_acc[:, :, N:], new)
    assert torch.isneginf(lse_acc[:, :, N + 1 : N + 2]).all()  # row 1: empty on both sides
    assert (o_acc[:, N + 1] == 0).all()
    torch.testing.assert_close(o_acc[:, N], o_blk[:, 0])  # row 0: acc empty -> takes blk
    torch.testing.assert_close(o_acc[:, N + 2], before_o[:, N + 2])  # row 2: blk empty -> keeps acc
    assert not torch.isnan(o_acc).any()


def test_rejects_low_precision_accumulators():
    with pytest.raises(TypeError, match="float32"):
        merge(
            torch.zeros(1, 2, 1, 4, dtype=torch.bfloat16),
            torch.zeros(1, 1, 2),
            torch.zeros(1, 2, 1, 4),
            torch.zeros(1, 1, 2),
        )
    with pytest.raises(ValueError, match="lse"):
        merge(torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 1), torch.zeros(1, 2, 1, 4), torch.zeros(1, 1, 2))


def test_rejects_blocks_of_another_shape():
    # Shapes that would broadcast (one row, one lse column) must raise, not merge silently.
    torch.manual_seed(3)
    o, lse = torch.randn(1, 4, 2, 8), torch.randn(1, 2, 4)
    with pytest.raises(ValueError, match="o_blk must have o's shape"):
        merge(o, lse, torch.randn(1, 1, 2, 8), torch.randn(1, 2, 4))
    with pytest.raises(ValueError, match="lse and lse_blk must have shape"):
        merge(o, lse, torch.randn(1, 4, 2, 8), torch.randn(1, 2, 1))
