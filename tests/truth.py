"""Float64 ground truth for attention: `softmax(Q Kᵀ · scale) V`, written as plainly as possible.

Independent of kernels/reference.py (which is itself under test): K/V heads are repeated for GQA,
the mask is built explicitly, gradients come from autograd.
"""

from __future__ import annotations

import math

import torch

# Relative-norm tolerances ‖x − truth‖ / ‖truth‖ per input dtype. fp32 runs in true fp32 (not tf32);
# fp16/bf16 round P before the P·V product and the output at the end.
TOL = {torch.float32: 2e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}


def attention_f64(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    scale: float | None = None,
    do: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Ground truth `o (B, Nq, H, D)`, `lse (B, H, Nq)`, and `dq, dk, dv` if `do` is given."""
    q64, k64, v64 = (t.detach().double().requires_grad_(do is not None) for t in (q, k, v))
    H, Hkv = q.shape[2], k.shape[2]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    kr = k64.repeat_interleave(H // Hkv, dim=2)
    vr = v64.repeat_interleave(H // Hkv, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q64, kr) * scale
    if causal:
        nq, nk = s.shape[-2:]
        s = s.masked_fill(torch.ones(nq, nk, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    o = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, dim=-1), vr)
    out = {"o": o.detach(), "lse": lse.detach()}
    if do is not None:
        o.backward(do.double())
        out.update(dq=q64.grad, dk=k64.grad, dv=v64.grad)
    return out


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """‖x − ref‖ / ‖ref‖ in float64; NaN anywhere in x gives inf so it never passes."""
    x64, ref64 = x.double(), ref.double()
    if not torch.isfinite(x64).all():
        return float("inf")
    return ((x64 - ref64).norm() / ref64.norm().clamp_min(1e-30)).item()


def lse_err(lse: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest absolute LSE error over finite entries; -inf must match -inf exactly."""
    if not torch.equal(torch.isneginf(lse), torch.isneginf(ref)) or torch.isnan(lse).any():
        return float("inf")
    finite = torch.isfinite(ref)
    return (lse.double()[finite] - ref.double()[finite]).abs().max().item() if finite.any() else 0.0
