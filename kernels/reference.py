"""The kernel contract in plain PyTorch: the CPU path for training and the oracle for tests.

Same signatures and conventions as the Triton kernels (DESIGN.md, layer 1):
layout `(B, N, H, D)`, GQA by grouping query heads over shared key/value heads (never
materialising repeated K/V), float32 math, LSE float32 in natural log with shape `(B, H, Nq)`.
Memory is O(Nq·Nk) per head, so this is for CPU and for tests, not for long sequences on GPU.
"""

from __future__ import annotations

import torch

from kernels.checks import check_bwd, check_qkv, resolve_scale


def _grouped(q: torch.Tensor, hkv: int) -> torch.Tensor:
    # (B, N, H, D) -> (B, Hkv, G, N, D): query head h uses key/value head h // G.
    B, N, H, D = q.shape
    return q.float().view(B, N, hkv, H // hkv, D).permute(0, 2, 3, 1, 4)


def _ungrouped(x: torch.Tensor) -> torch.Tensor:
    # (B, Hkv, G, N, D) -> (B, N, H, D)
    B, Hkv, G, N, D = x.shape
    return x.permute(0, 3, 1, 2, 4).reshape(B, N, Hkv * G, D)


def _scores(q: torch.Tensor, k: torch.Tensor, causal: bool, scale: float) -> torch.Tensor:
    """Scaled scores `(B, Hkv, G, Nq, Nk)` in float32, masked entries at -inf."""
    qg = _grouped(q, k.shape[2])
    kf = k.float().permute(0, 2, 1, 3)  # (B, Hkv, Nk, D)
    s = torch.einsum("bhgqd,bhkd->bhgqk", qg, kf) * scale
    if causal:
        nq, nk = s.shape[-2:]
        visible = torch.ones(nq, nk, dtype=torch.bool, device=s.device).tril()
        s = s.masked_fill(~visible, float("-inf"))
    return s


def _probabilities(s: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """P = exp(S - lse), with rows whose lse is -inf (no visible key) at exactly 0."""
    finite = torch.isfinite(lse)
    p = torch.exp(s - torch.where(finite, lse, 0.0).unsqueeze(-1))
    return torch.where(finite.unsqueeze(-1), p, 0.0)


def ref_attn_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of `q (B, Nq, H, D)` over `k, v (B, Nk, Hkv, D)`.

    Returns `o (B, Nq, H, D)` in `out_dtype` (default q's dtype) and `lse (B, H, Nq)` float32 (natural log).
    Rows with no visible key give `o = 0` and `lse = -inf`.
    """
    check_qkv(q, k, v, causal)
    scale = resolve_scale(softmax_scale, q.shape[-1])
    B, Nq, H, _ = q.shape
    s = _scores(q, k, causal, scale)  # (B, Hkv, G, Nq, Nk)
    lse = torch.logsumexp(s, dim=-1)  # -inf where a row sees nothing (or Nk == 0)
    p = _probabilities(s, lse)
    o = torch.einsum("bhgqk,bhkd->bhgqd", p, v.float().permute(0, 2, 1, 3))
    return _ungrouped(o).to(out_dtype or q.dtype), lse.reshape(B, H, Nq)


def ref_attn_bwd(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    grad_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of attention given `do`, the forward's inputs, and `o`, `lse`.

    `o` and `lse` may be the global ones of a ring merge rather than the ones this block
    produced: P is recomputed as `exp(S·scale − lse)` and `delta = rowsum(do·o)`, which is
    exactly what makes per-block gradients sum to the full gradient.
    Returns `dq (B, Nq, H, D)`, `dk, dv (B, Nk, Hkv, D)` in `grad_dtype` (default: q's dtype).
    """
    check_qkv(q, k, v, causal)
    check_bwd(do, q, o, lse)
    scale = resolve_scale(softmax_scale, q.shape[-1])
    out_dtype = grad_dtype or q.dtype
    B, Nq, H, _ = q.shape
    Hkv = k.shape[2]
    s = _scores(q, k, causal, scale)
    lse_g = lse.view(B, Hkv, H // Hkv, Nq)
    p = _probabilities(s, lse_g)  # (B, Hkv, G, Nq, Nk)
    dog = _grouped(do, Hkv)
    delta = (dog * _grouped(o, Hkv)).sum(-1)  # (B, Hkv, G, Nq)
    kf = k.float().permute(0, 2, 1, 3)
    vf = v.float().permute(0, 2, 1, 3)
    dv = torch.einsum("bhgqk,bhgqd->bhkd", p, dog)
    dp = torch.einsum("bhgqd,bhkd->bhgqk", dog, vf)
    ds = p * (dp - delta.unsqueeze(-1)) * scale
    dq = torch.einsum("bhgqk,bhkd->bhgqd", ds, kf)
    dk = torch.einsum("bhgqk,bhgqd->bhkd", ds, _grouped(q, Hkv))
    return (
        _ungrouped(dq).to(out_dtype),
        dk.permute(0, 2, 1, 3).to(out_dtype),
        dv.permute(0, 2, 1, 3).to(out_dtype),
    )
