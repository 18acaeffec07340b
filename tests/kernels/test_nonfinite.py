"""NaN and Inf in q, k or v propagate as in `torch.nn.functional.scaled_dot_product_attention`, on
every backend and through the ring's merge: a corrupted input is never a silently finite output."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ringflash.kernels import attn_fwd, interpreting, ref_merge

BACKENDS = ["reference", "triton"]


def _sdpa(q, k, v, causal):
    o = F.scaled_dot_product_attention(*(t.double().transpose(1, 2) for t in (q, k, v)), is_causal=causal)
    return o.transpose(1, 2)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("where", ["q", "k", "v", "q_inf", "k_inf"])
@pytest.mark.parametrize("causal", [False, True])
def test_nonfinite_inputs_propagate_like_sdpa(backend, where, causal):
    if backend == "triton" and not interpreting():
        pytest.skip("the Triton kernels run on CPU only in the interpreter")
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 16, 2, 32, generator=g) for _ in range(3))
    t = {"q": q, "k": k, "v": v}[where[0]]
    t[0, 5, 1, 3] = float("inf") if where.endswith("inf") else float("nan")
    o, _ = attn_fwd(q, k, v, causal=causal, backend=backend)
    want = _sdpa(q, k, v, causal)
    assert torch.equal(torch.isnan(o), torch.isnan(want)), (torch.isnan(o).sum(), torch.isnan(want).sum())
    assert torch.isnan(o).any(), "the corrupted entry must reach the output"
    finite = ~torch.isnan(want)
    torch.testing.assert_close(o[finite].double(), want[finite], atol=1e-5, rtol=1e-5)


def test_merge_keeps_a_nan_side_nan_and_two_empty_sides_zero():
    o = torch.zeros(1, 3, 1, 4)
    lse = torch.tensor([[[float("nan"), float("-inf"), 0.5]]])
    o_blk = torch.ones(1, 3, 1, 4)
    o_blk[0, 1] = 0  # a side that saw no key has o = 0 (the kernels' contract)
    lse_blk = torch.tensor([[[0.0, float("-inf"), float("nan")]]])
    o[0, 0] = float("nan")
    ref_merge(o, lse, o_blk, lse_blk)
    assert torch.isnan(o[0, 0]).all() and torch.isnan(lse[0, 0, 0])  # NaN on the accumulator's side
    assert torch.equal(o[0, 1], torch.zeros(1, 4)) and lse[0, 0, 1] == float("-inf")  # both empty
    assert torch.isnan(o[0, 2]).all() and torch.isnan(lse[0, 0, 2])  # NaN on the block's side
