"""NaN and Inf in q, k or v propagate as in `torch.nn.functional.scaled_dot_product_attention`, on
every backend and through the ring's merge: a corrupted input is never a silently finite output."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ringflash.kernels import attn_fwd, ref_merge
from tests.kernels.steps import BACKEND_DEVICES, skip_unless_runs


def _sdpa(q, k, v, causal):
    o = F.scaled_dot_product_attention(*(t.double().transpose(1, 2) for t in (q, k, v)), is_causal=causal)
    return o.transpose(1, 2)


@pytest.mark.parametrize("backend,device", BACKEND_DEVICES)
@pytest.mark.parametrize("where", ["q", "k", "v", "q_inf", "k_inf"])
@pytest.mark.parametrize("causal", [False, True])
def test_nonfinite_inputs_propagate_like_sdpa(backend, device, where, causal):
    skip_unless_runs(backend, device)
    g = torch.Generator().manual_seed(3)
    # bf16 on the GPU (what the hopper kernels take), 200 rows there: several key blocks
    n, dtype = (16, torch.float32) if device == "cpu" else (200, torch.bfloat16)
    q, k, v = (torch.randn(1, n, 2, 64, generator=g).to(device, dtype) for _ in range(3))
    t = {"q": q, "k": k, "v": v}[where[0]]
    t[0, 5, 1, 3] = float("inf") if where.endswith("inf") else float("nan")
    o, _ = attn_fwd(q, k, v, causal=causal, backend=backend)
    # On the CPU: CUDA's float64 SDPA adds the causal mask to the scores, so a NaN key reaches rows
    # that cannot see it (200 rows of 200 here, where the CPU's gives the 195 that can).
    want = _sdpa(q.cpu(), k.cpu(), v.cpu(), causal).to(device)
    nan_rows = lambda t: torch.isnan(t).any(-1).nonzero()[:, 1].unique().tolist()
    assert torch.equal(torch.isnan(o), torch.isnan(want)), (nan_rows(o), nan_rows(want))
    assert torch.isnan(o).any(), "the corrupted entry must reach the output"
    finite = ~torch.isnan(want)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(o[finite].double(), want[finite], atol=tol, rtol=tol)


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
