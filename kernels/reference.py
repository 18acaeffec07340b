"""The kernel contract in plain PyTorch: the CPU path for training and the oracle for tests.

Same signatures and conventions as the Triton kernels (kernels/__init__.py):
layout `(B, N, H, D)`, GQA by grouping query heads over shared key/value heads (never
materialising repeated K/V), float32 math, LSE float32 in natural log with shape `(B, H, Nq)`.
Memory is O(Nq·Nk) per head, so this is for CPU and for tests, not for long sequences on GPU.
"""

from __future__ import annotations

import torch

from ringflash.kernels.checks import aliases, check_bwd, check_qkv, resolve_fwd_outputs, resolve_scale
from ringflash.kernels.masks import Visibility
from ringflash.kernels.spec import AttnSpec, softcap_math


def _grouped(q: torch.Tensor, hkv: int) -> torch.Tensor:
    # (B, N, H, D) -> (B, Hkv, G, N, D): query head h uses key/value head h // G.
    B, N, H, D = q.shape
    return q.float().view(B, N, hkv, H // hkv, D).permute(0, 2, 3, 1, 4)


def _ungrouped(x: torch.Tensor) -> torch.Tensor:
    # (B, Hkv, G, N, D) -> (B, N, H, D)
    B, Hkv, G, N, D = x.shape
    return x.permute(0, 3, 1, 2, 4).reshape(B, N, Hkv * G, D)


def _scores(q: torch.Tensor, k: torch.Tensor, causal: bool, scale: float, vis: Visibility | None,
            softcap: float = 0.0) -> torch.Tensor:
    """Scaled (and softcapped) scores `(B, Hkv, G, Nq, Nk)` in float32, masked entries at -inf."""
    qg = _grouped(q, k.shape[2])
    kf = k.float().permute(0, 2, 1, 3)  # (B, Hkv, Nk, D)
    s = softcap_math(torch.einsum("bhgqd,bhkd->bhgqk", qg, kf) * scale, softcap)
    nq, nk = s.shape[-2:]
    if vis is not None:  # query row i sees key rows [kv_lo[i], kv_hi[i]) (kernels/masks.py)
        j = torch.arange(nk, device=s.device)
        visible = (j >= vis.kv_lo[..., None]) & (j < vis.kv_hi[..., None])  # (B or 1, Nq, Nk)
        s = s.masked_fill(~visible[:, None, None], float("-inf"))
    elif causal:
        visible = torch.ones(nq, nk, dtype=torch.bool, device=s.device).tril()
        s = s.masked_fill(~visible, float("-inf"))
    return s


def _probabilities(s: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """P = exp(S - lse), with rows whose lse is -inf (no visible key) at exactly 0. A NaN or +inf
    in a row's scores makes its lse NaN or +inf and its P NaN, as in SDPA: never a silent 0."""
    empty = lse == float("-inf")
    p = torch.exp(s - torch.where(empty, 0.0, lse).unsqueeze(-1))
    return torch.where(empty.unsqueeze(-1), 0.0, p)


@torch.no_grad()  # plain tensors out, as from the Triton kernels: no autograd graph
def ref_attn_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    spec: AttnSpec,
    softmax_scale: float | None = None,
    *,
    out_dtype: torch.dtype | None = None,
    acc: tuple[torch.Tensor, torch.Tensor] | None = None,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of `q (B, Nq, H, D)` over `k (B, Nk, Hkv, D)`, `v (B, Nk, Hkv, Dv)`.

    Returns `o (B, Nq, H, Dv)` in `out_dtype` (default q's dtype) and `lse (B, H, Nq)` float32 (natural log).
    Rows with no visible key give `o = 0` and `lse = -inf`. With `acc=(o_acc, lse_acc)` (float32)
    the result is merged into the accumulator in place (`ref_merge`) and `acc` is returned.
    `out`: where o goes instead (o_acc is then only read, and may be in q's dtype; `(out, lse)`
    is returned), as in `Backend.fwd_step`. `spec`: kernels/spec.py.
    """
    check_qkv(q, k, v)
    vis = spec.intervals_for(q, k)
    o_out, lse_out = resolve_fwd_outputs(q, v, out_dtype, acc, out)
    scale = resolve_scale(softmax_scale, q.shape[-1])
    B, Nq, H, _ = q.shape
    s = _scores(q, k, spec.causal, scale, vis, spec.softcap)  # (B, Hkv, G, Nq, Nk)
    lse = torch.logsumexp(s, dim=-1)  # -inf where a row sees nothing (or Nk == 0)
    p = _probabilities(s, lse)
    o = _ungrouped(torch.einsum("bhgqk,bhkd->bhgqd", p, v.float().permute(0, 2, 1, 3)))
    lse = lse.reshape(B, H, Nq)
    if acc is None:
        lse_out.copy_(lse)
        return o_out.copy_(o), lse_out
    ref_merge(acc[0], lse_out, o, lse, out=out)
    return o_out, lse_out


@torch.no_grad()
def ref_merge(
    o: torch.Tensor, lse: torch.Tensor, o_blk: torch.Tensor, lse_blk: torch.Tensor, *, out: torch.Tensor | None = None
) -> None:
    """Merge a block result `(o_blk, lse_blk)` into the running float32 `(o, lse)`, in place (or to `out`).

    If `(o, lse)` is attention over keys A and `(o_blk, lse_blk)` over keys B (A ∩ B = ∅), the
    result is attention over A ∪ B:

        lse' = logaddexp(lse, lse_blk),   o' = o·σ(−d) + o_blk·σ(d),   d = lse_blk − lse

    (the same as `o·exp(lse − lse') + o_blk·exp(lse_blk − lse')`, but sigmoids of the difference
    stay exact to float32 precision where |lse| is large, and lie in [0, 1] so nothing overflows).
    A side with lse = −inf (no key seen) gets weight exactly 0; a row with −inf on both sides
    keeps lse = −inf and o = 0, never NaN. This is the math the Triton forward fuses (`acc=`).

    o: `(B, N, H, D)` float32 (a view, e.g. some rows of a larger one, is fine; see `out`); lse: `(B, H, N)`
    float32, natural log; o_blk: like o in any float dtype; lse_blk: `(B, H, N)` float32.
    `out`: where the merged o goes instead (o's shape, any float dtype, e.g. the inputs' to round
    a ring's last step); o is then only read, so it may be in any float dtype too (a block result
    its backend rounded). lse is updated either way.
    """
    in_place = out is None or aliases(out, o)  # the kernels' rule (kernels/checks.py), not object identity
    if (o.dtype != torch.float32 and in_place) or lse.dtype != torch.float32 or lse_blk.dtype != torch.float32:
        raise TypeError(f"merge accumulates in float32: got o {o.dtype}, lse {lse.dtype}, lse_blk {lse_blk.dtype}")
    if o.shape != o_blk.shape:
        raise ValueError(f"o_blk must have o's shape {tuple(o.shape)}, got {tuple(o_blk.shape)}")
    if out is not None and out.shape != o.shape:
        raise ValueError(f"out must have o's shape {tuple(o.shape)}, got {tuple(out.shape)}")
    B, N, H, _ = o.shape
    if lse.shape != (B, H, N) or lse_blk.shape != (B, H, N):
        raise ValueError(
            f"lse and lse_blk must have shape (B, H, N) = {(B, H, N)}, "
            f"got {tuple(lse.shape)} and {tuple(lse_blk.shape)}"
        )
    new = torch.logaddexp(lse, lse_blk)  # -inf only where both are -inf
    d = lse_blk - lse
    # Both sides empty: d is NaN; any finite weight works because o and o_blk are 0 there. A NaN
    # of either side (NaN in q, k or v) stays NaN, as SDPA would give.
    both_empty = (lse == float("-inf")) & (lse_blk == float("-inf"))
    d = torch.where(both_empty, 0.0, d).transpose(1, 2).unsqueeze(-1)  # (B, N, H, 1)
    if in_place:
        o.mul_(torch.sigmoid(-d)).addcmul_(o_blk, torch.sigmoid(d))
    else:
        out.copy_(torch.addcmul(o * torch.sigmoid(-d), o_blk, torch.sigmoid(d)))
    lse.copy_(new)


@torch.no_grad()  # plain tensors out, as from the Triton kernels: no autograd graph
def ref_attn_bwd(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    spec: AttnSpec,
    softmax_scale: float | None = None,
    *,
    grad_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of attention given `do`, the forward's inputs, and `o`, `lse`.

    `o` and `lse` may be the global ones of a ring merge rather than the ones this block
    produced: P is recomputed as `exp(S·scale − lse)` and `delta = rowsum(do·o)`, which is
    exactly what makes per-block gradients sum to the full gradient.
    Returns `dq`, `dk`, `dv` shaped like q, k, v, in `grad_dtype` (default: q's dtype).
    """
    check_qkv(q, k, v)
    vis = spec.intervals_for(q, k)
    check_bwd(do, q, v, o, lse)
    scale = resolve_scale(softmax_scale, q.shape[-1])
    out_dtype = grad_dtype or q.dtype
    B, Nq, H, _ = q.shape
    Hkv = k.shape[2]
    s = _scores(q, k, spec.causal, scale, vis, spec.softcap)
    lse_g = lse.view(B, Hkv, H // Hkv, Nq)
    p = _probabilities(s, lse_g)  # (B, Hkv, G, Nq, Nk)
    dog = _grouped(do, Hkv)
    delta = (dog * _grouped(o, Hkv)).sum(-1)  # (B, Hkv, G, Nq)
    kf = k.float().permute(0, 2, 1, 3)
    vf = v.float().permute(0, 2, 1, 3)
    dv = torch.einsum("bhgqk,bhgqd->bhkd", p, dog)
    dp = torch.einsum("bhgqd,bhkd->bhgqk", dog, vf)
    ds = p * (dp - delta.unsqueeze(-1)) * scale
    if spec.softcap:  # d(c·tanh(x/c))/dx = 1 − tanh², tanh = s/c; masked s (-inf) clamp to a 0 factor
        c = spec.softcap
        ds = ds * (1 - (s.clamp(-c, c) / c) ** 2)
    dq = torch.einsum("bhgqk,bhkd->bhgqd", ds, kf)
    dk = torch.einsum("bhgqk,bhgqd->bhkd", ds, _grouped(q, Hkv))
    return (
        _ungrouped(dq).to(out_dtype),
        dk.permute(0, 2, 1, 3).to(out_dtype),
        dv.permute(0, 2, 1, 3).to(out_dtype),
    )
