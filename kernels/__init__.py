"""Attention kernels: plain tensors in, plain tensors out (no autograd, no distributed).

    o, lse = attn_fwd(q, k, v, causal=True)                       # flash_attn style
    dq, dk, dv = attn_bwd(do, q, k, v, o, lse, causal=True)
    o, lse = attn_varlen_fwd(q, k, v, cu_seqlens, causal=True)   # packed documents

Conventions: q `(B, Nq, H, D)`, k `(B, Nk, Hkv, D)` and v `(B, Nk, Hkv, Dv)` with H % Hkv == 0 (v's
head dim may differ: DeepSeek's MLA), any strides with a contiguous last dim; o `(B, Nq, H, Dv)`;
lse `(B, H, Nq)` float32, natural log. Rows with no visible key give o = 0
and lse = -inf; NaN or Inf in the inputs propagate as in SDPA.

What each query sees is an `AttnSpec` (kernels/spec.py), built here from `causal=` / `window_size=`.
Which implementation runs is a `Backend` (kernels/backends.py: `triton`, `reference`, `cudnn`,
`hopper`, `auto`), chosen from `backend=` or `RINGFLASH_KERNEL_BACKEND`. Block-wise callers (the ring) use
the backends' step API, which merges and accumulates into given buffers.
"""

from __future__ import annotations

import torch

from ringflash.kernels.backends import BACKENDS, Backend, backend_named, device_guard, get_backend, interpreting
from ringflash.kernels.masks import (
    Visibility,
    check_window,
    dense_visibility,
    refuse_window,
    varlen_visibility,
    visibility,
)
from ringflash.kernels.reference import ref_merge
from ringflash.kernels.spec import CAUSAL, FULL, AttnSpec, check_softcap, mask_kind

__all__ = ["BACKENDS", "CAUSAL", "FULL", "AttnSpec", "Backend", "Visibility", "attn_bwd", "attn_fwd",
           "attn_varlen_bwd", "attn_varlen_fwd", "backend_named", "check_softcap", "check_window", "dense_visibility",
           "device_guard", "get_backend", "interpreting", "mask_kind", "ref_merge", "refuse_window",
           "varlen_visibility", "visibility"]


def _spec(causal: bool, window_size, spec: AttnSpec | None, softcap: float, window) -> AttnSpec:
    refuse_window(window)
    if spec is None:
        return AttnSpec.from_window_size(window_size, causal=causal).with_softcap(softcap)
    if not isinstance(spec, AttnSpec):
        raise TypeError(f"spec must be a kernels.AttnSpec or None, got {type(spec).__name__}")
    if causal or window_size not in ((-1, -1), [-1, -1]) or softcap:
        raise ValueError("give spec= or causal=/window_size=/softcap=, not both: the spec already says it")
    return spec


def attn_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
    spec: AttnSpec | None = None,
    backend: str | None = None,
    softcap: float = 0.0,
    window: None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention forward.

    Args:
        q: `(B, Nq, H, D)`; k: `(B, Nk, Hkv, D)`; v: `(B, Nk, Hkv, Dv)`, H % Hkv == 0; fp16, bf16 or fp32.
        causal: query i sees key j <= i (needs Nq == Nk).
        softmax_scale: default `1/sqrt(D)`.
        window_size: flash_attn's `(left, right)`: query i sees keys i − left ... i + right (-1: no
            limit); with causal `(w − 1, 0)` is a sliding window of w keys counting the diagonal.
        spec: any `AttnSpec` instead of causal/window_size/softcap (e.g. per-row key intervals).
        backend: `BACKENDS` name; None reads `RINGFLASH_KERNEL_BACKEND` (default auto).
        softcap: scores `c·tanh(s/c)` before the mask (flash_attn's); 0.0: none.
        window: the old name, refused with a TypeError naming `window_size`.
    Returns:
        o: `(B, Nq, H, Dv)` in q's dtype; lse: `(B, H, Nq)` float32, natural log.
    """
    with device_guard(q):
        spec = _spec(causal, window_size, spec, softcap, window)
        return get_backend(backend, q.device).fwd_step(q, k, v, spec, softmax_scale)


def attn_bwd(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
    spec: AttnSpec | None = None,
    backend: str | None = None,
    softcap: float = 0.0,
    window: None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention backward: the gradients of `attn_fwd` with the same mask arguments.

    Args:
        do, o: `(B, Nq, H, Dv)`; lse: `(B, H, Nq)` float32. o and lse may be global ones (a ring's merged
            result): P and rowsum(do·o) are recomputed from them.
        causal, softmax_scale, window_size, spec, backend, softcap, window: as given to `attn_fwd`.
    Returns:
        dq, dk, dv like q, k, v, in q's dtype.
    """
    with device_guard(q):
        spec = _spec(causal, window_size, spec, softcap, window)
        return get_backend(backend, q.device).bwd_step(do, q, k, v, o, lse, spec, softmax_scale)


from ringflash.kernels import ops  # noqa: E402, F401  (registers torch.ops.ringflash.attn_fwd / attn_bwd)
from ringflash.kernels.varlen import attn_varlen_bwd, attn_varlen_fwd  # noqa: E402  (uses attn_fwd/attn_bwd above)
