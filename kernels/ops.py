"""The kernels as PyTorch custom ops, for `torch.compile` and autograd.

    o, lse = torch.ops.ringflash.attn_fwd(q, k, v, [], causal=True)   # differentiable in q, k, v
    dq, dk, dv = torch.ops.ringflash.attn_bwd(do, q, k, v, o, lse, [], causal=True)

Under `torch.compile` Dynamo would otherwise trace into the dispatcher and the Triton launch (or
the reference's einsums); as custom ops each is one node of the graph, with a fake implementation
(shapes and dtypes only) and, for `attn_fwd`, a backward that calls `attn_bwd`. They take every
argument `kernels.attn_fwd` / `attn_bwd` take: `causal`, `window_size` (flash_attn's
`[left, right]`, a list as op schemas spell a pair; None: no window), `softcap`, and per-row key
intervals as the tensor list `intervals` (`[]`, or a `Visibility`'s four tensors).

Outputs are new contiguous tensors (the reference's dk and dv are permuted views, copied here).
`lse` is not differentiable.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ringflash.kernels.backends import device_guard, get_backend
from ringflash.kernels.masks import Visibility
from ringflash.kernels.spec import AttnSpec

__all__ = ["attn_bwd", "attn_fwd"]


@torch.library.custom_op("ringflash::attn_fwd", mutates_args=())
def attn_fwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    intervals: list[Tensor],
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    window_size: list[int] | None = None,
    backend: str | None = None,
    softcap: float = 0.0,
) -> tuple[Tensor, Tensor]:
    """`kernels.attn_fwd` as an op: `o (B, Nq, H, Dv)` in q's dtype, `lse (B, H, Nq)` float32."""
    # Autocast must not recast the reference's float32 math (the op gets no autocast rule, so its
    # inputs arrive as the caller made them, but ops inside would still be autocast).
    with torch.autocast(q.device.type, enabled=False), device_guard(q):
        spec = _spec(causal, window_size, intervals, softcap)
        o, lse = get_backend(backend, q.device).fwd_step(q, k, v, spec, softmax_scale)
    return o.contiguous(), lse.contiguous()


def _spec(causal: bool, window_size: list[int] | None, intervals: list[Tensor], softcap: float) -> AttnSpec:
    window = None if window_size is None else AttnSpec.from_window_size(window_size, causal=causal).window
    if intervals:  # AttnSpec refuses causal or window beside them, which the intervals would override
        return AttnSpec(causal=causal, window=window, intervals=Visibility(*intervals), softcap=softcap)
    return AttnSpec(causal=causal, window=window, softcap=softcap)


@attn_fwd.register_fake
def _(q, k, v, intervals, *, causal=False, softmax_scale=None, window_size=None, backend=None, softcap=0.0):
    B, Nq, H, _ = q.shape
    return q.new_empty((B, Nq, H, v.shape[3])), q.new_empty((B, H, Nq), dtype=torch.float32)


@torch.library.custom_op("ringflash::attn_bwd", mutates_args=())
def attn_bwd(
    do: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    o: Tensor,
    lse: Tensor,
    intervals: list[Tensor],
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    window_size: list[int] | None = None,
    backend: str | None = None,
    softcap: float = 0.0,
) -> tuple[Tensor, Tensor, Tensor]:
    """`kernels.attn_bwd` as an op: `dq`, `dk`, `dv` shaped like q, k, v, in q's dtype."""
    with torch.autocast(q.device.type, enabled=False), device_guard(q):
        grads = get_backend(backend, q.device).bwd_step(
            do, q, k, v, o, lse, _spec(causal, window_size, intervals, softcap), softmax_scale
        )
    return tuple(g.contiguous() for g in grads)


@attn_bwd.register_fake
def _(do, q, k, v, o, lse, intervals, *, causal=False, softmax_scale=None, window_size=None, backend=None, softcap=0.0):
    return q.new_empty(q.shape), q.new_empty(k.shape), q.new_empty(v.shape)


def _fwd_setup_context(ctx, inputs, keyword_only_inputs, output):
    q, k, v, intervals = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, *intervals)
    keys = ("causal", "softmax_scale", "window_size", "backend", "softcap")
    ctx.kwargs = {key: keyword_only_inputs[key] for key in keys}
    ctx.mark_non_differentiable(lse)


def _fwd_backward(ctx, do, _dlse):
    q, k, v, o, lse, *intervals = ctx.saved_tensors
    dq, dk, dv = attn_bwd(do.contiguous(), q, k, v, o, lse, intervals, **ctx.kwargs)
    return dq, dk, dv, [None] * len(intervals)


attn_fwd.register_autograd(_fwd_backward, setup_context=_fwd_setup_context)
