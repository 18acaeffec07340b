"""The kernels as PyTorch custom ops, for `torch.compile` and autograd.

    o, lse = torch.ops.ringflash.attn_fwd(q, k, v, causal=True)   # differentiable in q, k, v
    dq, dk, dv = torch.ops.ringflash.attn_bwd(do, q, k, v, o, lse, causal=True)

`kernels.attn_fwd` / `kernels.attn_bwd` are plain Python: under `torch.compile` Dynamo would
trace into the dispatcher and the Triton launch (or the reference's einsums) instead of seeing
one opaque call. Registered with `torch.library.custom_op`, each is a single node in the graph,
with a fake implementation (shapes and dtypes only) for tracing and, for `attn_fwd`, a backward
that calls `attn_bwd`. The wrappers are thin on purpose: same arguments as the dispatcher, which
keeps doing every check and the backend choice at run time.

Contract beyond `kernels.attn_fwd/attn_bwd` (what the fake implementations promise): outputs are
new contiguous tensors. The reference backend's dk and dv are permuted views, so they are copied
here; the Triton outputs are already contiguous and pass unchanged. `lse` is not differentiable
(nothing upstream needs its gradient, and the kernels do not compute it).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ringflash import kernels

__all__ = ["attn_bwd", "attn_fwd"]


@torch.library.custom_op("ringflash::attn_fwd", mutates_args=())
def attn_fwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    out_dtype: torch.dtype | None = None,
    backend: str | None = None,
) -> tuple[Tensor, Tensor]:
    """`kernels.attn_fwd` as an op: `o (B, Nq, H, D)` in `out_dtype` (default q's), `lse (B, H, Nq)` float32."""
    # Autocast must not recast the reference's float32 math (the op gets no autocast rule, so its
    # inputs arrive as the caller made them, but ops inside would still be autocast).
    with torch.autocast(q.device.type, enabled=False):
        o, lse = kernels.attn_fwd(
            q, k, v, causal=causal, softmax_scale=softmax_scale, out_dtype=out_dtype, backend=backend
        )
    return o.contiguous(), lse.contiguous()


@attn_fwd.register_fake
def _(q, k, v, *, causal=False, softmax_scale=None, out_dtype=None, backend=None):
    B, Nq, H, _ = q.shape
    return q.new_empty(q.shape, dtype=out_dtype or q.dtype), q.new_empty((B, H, Nq), dtype=torch.float32)


@torch.library.custom_op("ringflash::attn_bwd", mutates_args=())
def attn_bwd(
    do: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    o: Tensor,
    lse: Tensor,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    grad_dtype: torch.dtype | None = None,
    backend: str | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """`kernels.attn_bwd` as an op: `dq` like q, `dk`, `dv` like k, in `grad_dtype` (default q's)."""
    with torch.autocast(q.device.type, enabled=False):
        grads = kernels.attn_bwd(
            do, q, k, v, o, lse, causal=causal, softmax_scale=softmax_scale, grad_dtype=grad_dtype, backend=backend
        )
    return tuple(g.contiguous() for g in grads)


@attn_bwd.register_fake
def _(do, q, k, v, o, lse, *, causal=False, softmax_scale=None, grad_dtype=None, backend=None):
    dtype = grad_dtype or q.dtype
    return q.new_empty(q.shape, dtype=dtype), k.new_empty(k.shape, dtype=dtype), v.new_empty(v.shape, dtype=dtype)


def _fwd_setup_context(ctx, inputs, keyword_only_inputs, output):
    q, k, v = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse)
    ctx.kwargs = {key: keyword_only_inputs[key] for key in ("causal", "softmax_scale", "backend")}
    ctx.mark_non_differentiable(lse)


def _fwd_backward(ctx, do, _dlse):
    q, k, v, o, lse = ctx.saved_tensors
    # Gradients in the inputs' dtype (autograd wants them so), whatever out_dtype the forward used.
    dq, dk, dv = attn_bwd(do.contiguous(), q, k, v, o, lse, grad_dtype=q.dtype, **ctx.kwargs)
    return dq, dk, dv


attn_fwd.register_autograd(_fwd_backward, setup_context=_fwd_setup_context)
