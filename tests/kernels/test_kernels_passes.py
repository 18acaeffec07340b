"""kernels/triton_passes.py: the one-pass merge and sum-and-round that the cuDNN backend uses.

Checked on CPU under the Triton interpreter (and compiled with `-m gpu`) against the eager math:
`kernels.ref_merge` for the merge, float32 `acc + grad` rounded once for the sum, on row-slice
views of larger buffers (as the ring passes them), with rows that saw no key on either side.
"""

from __future__ import annotations

import pytest
import torch

from ringflash.kernels import interpreting, ref_merge
from ringflash.kernels.triton_passes import add_into, merge_into

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _skip_cpu_without_interpreter(device):
    if device == "cpu" and not interpreting():
        pytest.skip("the CPU case runs under the Triton interpreter (the CPU suite)")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, None], ids=str)  # None: into o_acc
@pytest.mark.parametrize("D", [64, 96])
def test_merge_matches_ref_merge(device, out_dtype, D):
    _skip_cpu_without_interpreter(device)
    g = torch.Generator().manual_seed(0)
    B, N, H, pad = 2, 45, 3, 4
    o_big = torch.randn(B, N + 2 * pad, H, D, generator=g)
    lse_big = torch.randn(B, H, N + 2 * pad, generator=g) * 4
    o_acc, lse_acc = o_big[:, pad:-pad], lse_big[:, :, pad:-pad]  # strided views, as the ring's rows
    o_blk = torch.randn(B, N, H, D, generator=g).to(torch.bfloat16)
    lse_blk = torch.randn(B, H, N, generator=g) * 4
    lse_acc[:, :, :3] = float("-inf")  # rows that saw no key so far
    lse_blk[:, :, 2:5] = float("-inf")  # and rows this block has no key for (row 2: neither)
    o_acc[:, :3] = 0
    o_blk[:, 2:5] = 0
    want_o, want_lse = o_acc.clone(), lse_acc.clone()
    ref_merge(want_o, want_lse, o_blk, lse_blk)
    o_big, lse_big, o_blk, lse_blk = (t.to(device) for t in (o_big, lse_big, o_blk, lse_blk))
    o_acc, lse_acc = o_big[:, pad:-pad], lse_big[:, :, pad:-pad]
    before = o_big.clone()
    out = o_acc if out_dtype is None else torch.full((B, N, H, D), 7.0, device=device).to(out_dtype)
    merge_into(o_acc, lse_acc, o_blk, lse_blk, out)
    torch.testing.assert_close(lse_acc.cpu(), want_lse, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.cpu().float(), want_o.to(out.dtype).float(), atol=1e-5, rtol=1e-2)
    assert torch.isfinite(out).all() and torch.isneginf(lse_acc[:, :, 2]).all()
    if out_dtype is not None:  # o_acc only read
        assert torch.equal(o_big, before)
    else:  # rows outside the view untouched
        assert torch.equal(o_big[:, :pad], before[:, :pad]) and torch.equal(o_big[:, -pad:], before[:, -pad:])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16, None], ids=str)  # None: in place
def test_add_sums_in_float32_and_rounds_once(device, out_dtype):
    _skip_cpu_without_interpreter(device)
    g = torch.Generator().manual_seed(1)
    B, N, H, D = 2, 37, 2, 128
    acc_big = torch.randn(B, N + 6, H, D, generator=g).to(device)
    acc = acc_big[:, 3:-3]
    grad = (torch.randn(B, N, H, D, generator=g) * 1e-3).to(device, torch.bfloat16)  # small: rounding shows
    want = (acc + grad.float()).to(out_dtype or torch.float32)
    out = acc if out_dtype is None else torch.empty(B, N, H, D, device=device, dtype=out_dtype)
    add_into(acc, grad, out)
    if device == "cpu" and out_dtype == torch.bfloat16:  # the interpreter truncates casts to bf16
        torch.testing.assert_close(out.float(), want.float(), atol=0, rtol=2**-7)
    else:
        assert torch.equal(out, want)
