"""Ground truth for the score transforms and two-sided windows: plain `softmax` attention with a
softcap, a learnable sink and any boolean mask, in float64 (the oracle) or in the inputs' own
dtype (the naive implementation flash_attn's tests compare against: an error at most twice the
naive one's, plus a small atol, passes).

Shares no code with ringflash: K/V heads are repeated for GQA, gradients come from autograd.
"""

from __future__ import annotations

import math

import torch

# flash_attn's criterion: |x − truth| ≤ 2·|naive − truth| + atol, max over elements, with atol
# ATOL × max|truth|: the Triton kernels round P and dS to bf16 for their products (as flash_attn
# does) where a naive bf16 softmax over capped scores keeps some of them exact, so a bf16 atol of
# about one rounding step of the largest value is needed (the uncapped kernels' error is the same).
ATOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2}


def band(nq: int, nk: int, left: int = -1, right: int = -1, causal: bool = False) -> torch.Tensor:
    """`(nq, nk)` bool: query i sees key j within [i − left, i + right] (-1: no limit), j ≤ i if causal."""
    i = torch.arange(nq)[:, None]
    j = torch.arange(nk)[None, :]
    ok = torch.ones(nq, nk, dtype=torch.bool)
    if left >= 0:
        ok &= j >= i - left
    if right >= 0:
        ok &= j <= i + right
    if causal:
        ok &= j <= i
    return ok


def attention(q, k, v, *, visible=None, scale=None, softcap=0.0, sink=None, do=None, dtype=torch.float64):
    """`o (B, Nq, H, D)`, `lse (B, H, Nq)` (the sink included), and with `do` the gradients `dq, dk, dv`
    (and `dsink (H,)`), computed in `dtype`. `visible (Nq, Nk)` bool, or any shape that broadcasts to
    `(B, H, Nq, Nk)` (one mask per batch row); `sink (H,)`: a logit per head that joins every row's
    softmax with a zero value."""
    leaves = [t.detach().to(dtype).requires_grad_(do is not None) for t in (q, k, v)]
    s_leaf = None if sink is None else sink.detach().to(dtype).requires_grad_(do is not None)
    q_, k_, v_ = leaves
    H, Hkv = q.shape[2], k.shape[2]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    kr, vr = (t.repeat_interleave(H // Hkv, dim=2) for t in (k_, v_))
    s = torch.einsum("bqhd,bkhd->bhqk", q_, kr) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if visible is not None:
        s = s.masked_fill(~visible, float("-inf"))
    if s_leaf is not None:
        B, _, Nq, _ = s.shape
        s = torch.cat([s, s_leaf.view(1, H, 1, 1).expand(B, H, Nq, 1)], dim=-1)
        vr = torch.cat([vr, vr.new_zeros(vr.shape[0], 1, *vr.shape[2:])], dim=1)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.softmax(s, dim=-1).nan_to_num()
    o = torch.einsum("bhqk,bkhd->bqhd", p, vr)
    out = {"o": o.detach(), "lse": lse.detach()}
    if do is not None:
        o.backward(do.to(dtype))
        out.update(dq=q_.grad, dk=k_.grad, dv=v_.grad)
        if s_leaf is not None:
            out["dsink"] = s_leaf.grad
    return out


def assert_close(got: dict, truth: dict, naive: dict, dtype: torch.dtype, keys=("o", "dq", "dk", "dv")) -> None:
    """flash_attn's criterion on every key: max error ≤ 2 × the naive same-dtype one's + ATOL."""
    for key in keys:
        err = (got[key].double() - truth[key].double()).abs().max().item()
        scale = max(1.0, truth[key].abs().max().item())
        bound = 2 * (naive[key].double() - truth[key].double()).abs().max().item() + ATOL[dtype] * scale
        assert err <= bound, f"{key}: error {err:.3g} > bound {bound:.3g}"
