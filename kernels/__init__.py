"""Attention kernels: plain tensors in, plain tensors out (no autograd, no distributed).

`attn_fwd` / `attn_bwd` dispatch to the Triton FlashAttention-2 kernels on CUDA and to the
PyTorch reference on CPU. Force either with the `backend=` argument or the environment
variable `RINGFLASH_KERNEL_BACKEND` (`auto`, `triton`, `reference`, `cudnn`). On CPU the Triton
kernels run only under the interpreter (`TRITON_INTERPRET=1`, set before Triton is imported);
that is how the test suite checks them without a GPU. `cudnn` (CUDA only, never chosen by
`auto`) runs NVIDIA's cuDNN attention through PyTorch for causal and full attention:
faster kernels on Hopper, with the differences kernels/cudnn.py lists.

Conventions: q `(B, Nq, H, D)`, k and v `(B, Nk, Hkv, D)` with H % Hkv == 0,
any strides with a contiguous last dim; lse `(B, H, Nq)` float32, natural log.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from ringflash.kernels.checks import check_grad_out
from ringflash.kernels.masks import Visibility, dense_visibility, varlen_visibility, visibility
from ringflash.kernels.reference import ref_attn_bwd, ref_attn_fwd, ref_merge

BACKENDS = ("auto", "triton", "reference", "cudnn")

__all__ = ["BACKENDS", "Visibility", "attn_bwd", "attn_fwd", "attn_varlen_bwd", "attn_varlen_fwd",
           "dense_visibility", "interpreting", "partial_dtype", "ref_attn_bwd", "ref_attn_fwd", "ref_merge",
           "resolve_backend", "varlen_visibility", "visibility"]


def interpreting() -> bool:
    """Whether Triton runs in its interpreter (TRITON_INTERPRET=1): the kernels' CPU path."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def resolve_backend(backend: str | None, device: torch.device) -> str:
    """The backend that will run for tensors on `device`: `"triton"`, `"reference"` or `"cudnn"`."""
    choice, source = backend, "backend"
    if choice is None:
        choice, source = os.environ.get("RINGFLASH_KERNEL_BACKEND", "auto"), "RINGFLASH_KERNEL_BACKEND"
    if choice not in BACKENDS:
        raise ValueError(f"{source} must be one of {BACKENDS}, got {choice!r}")
    if choice == "auto":
        return "triton" if device.type == "cuda" else "reference"
    if choice == "cudnn" and device.type != "cuda":
        raise ValueError(f"{source}='cudnn' needs CUDA tensors, got {device.type} ones: use 'auto' or 'reference'")
    if choice == "triton" and device.type != "cuda" and not interpreting():
        raise ValueError(
            f"backend='triton' on a {device.type} tensor needs the Triton interpreter: "
            "set TRITON_INTERPRET=1 before importing triton, or use backend='reference'"
        )
    return choice


def partial_dtype(backend: str | None, q: torch.Tensor) -> torch.dtype:
    """The dtype in which the backend's kernels hand over a block's o or gradients for q's inputs
    unrounded: float32 on the Triton and reference backends (they compute in float32), q's own on
    cuDNN (its kernels round to it). The ring keeps a partial result that only one more step reads
    in this dtype: float32 would hold a cuDNN result unchanged, at twice the bytes and a cast."""
    return q.dtype if resolve_backend(backend, q.device) == "cudnn" else torch.float32


def attn_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    out_dtype: torch.dtype | None = None,
    acc: tuple[torch.Tensor, torch.Tensor] | None = None,
    out: torch.Tensor | None = None,
    window: int | None = None,
    visibility: Visibility | None = None,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention forward: returns `o` shaped like q in `out_dtype` (default q's) and
    `lse (B, H, Nq)` float32 (natural log). Rows with no visible key give `o = 0`, `lse = -inf`.

    `out_dtype=torch.float32` keeps a partial result unrounded for a caller that merges several
    (on the Triton and reference backends; cuDNN's is rounded to q's dtype first: kernels/cudnn.py).
    `acc=(o_acc, lse_acc)`: a running float32 accumulator, `o_acc (B, Nq, H, D)` and
    `lse_acc (B, H, Nq)`, views of larger buffers allowed (e.g. `o[:, rows]`, `lse[:, :, rows]`);
    with `out=`, o_acc may be in q's dtype too (`partial_dtype`: a cuDNN result, only read).
    This block's result is merged into it in place, exactly (`kernels.reference.ref_merge`:
    lse = logaddexp, weights σ(∓d); −inf on either or both sides is safe), and `acc` is
    returned (`(out, lse_acc)` with `out=`). The Triton kernel does it in its epilogue: one
    launch, no extra pass over O.
    `out`: where o goes (shaped like q, in its own dtype; views fine) instead of a new tensor or,
    with `acc`, o_acc (then only read; lse_acc is still updated): the ring's last step writes its
    merged o rounded to q's dtype this way, without a separate cast.
    `window=w` (with causal=True, Nq == Nk): causal sliding window, query i sees keys
    i − w < j <= i, w keys counting the diagonal (flash_attn's `window_size=(w − 1, 0)`).
    `visibility=`: any per-row key intervals, e.g. packed documents at global positions
    (`kernels.visibility`, kernels/masks.py); it replaces `causal` and `window`, and Nq, Nk are free.
    """
    kw = dict(causal=causal, softmax_scale=softmax_scale, out_dtype=out_dtype, acc=acc, out=out, window=window,
              visibility=visibility)
    which = resolve_backend(backend, q.device)
    if which == "reference":
        return ref_attn_fwd(q, k, v, **kw)
    if which == "cudnn":
        from ringflash.kernels.cudnn import cudnn_attn_fwd

        return cudnn_attn_fwd(q, k, v, **kw)
    from ringflash.kernels.triton_fwd import triton_attn_fwd

    return triton_attn_fwd(q, k, v, **kw)


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
    grad_dtype: torch.dtype | None = None,
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    accumulate: bool = False,
    acc: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    window: int | None = None,
    visibility: Visibility | None = None,
    after_dkdv: Callable[[], None] | None = None,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention backward: returns `dq` like q, `dk`, `dv` like k, in `grad_dtype` (default q's).

    `o` and `lse` may be global (from a ring merge); P and delta are recomputed from them.
    `out=(dq, dk, dv)`: write into these (views of larger buffers are fine) instead of new
    tensors; with `accumulate=True` the gradients are added to what `out` holds (in float32 on
    chip), which is how the ring sums its steps' dq and dK/dV without a separate pass. (cuDNN's
    gradients are rounded to q's dtype before they are added, in a separate pass: kernels/cudnn.py.)
    `acc=(dq_acc, dk_acc, dv_acc)` (shaped like out; float32, or in q's dtype if only read, not
    `out` itself: `partial_dtype`): the gradients are added to what these hold (in float32) and
    the sums written to `out`, in `grad_dtype`: the ring's last step rounds its sums to the input
    dtype this way, without a separate cast.
    `window`, `visibility`: the forward's mask (see `attn_fwd`).
    `after_dkdv()`: called once dk and dv are final, written or added (on CUDA: once their
    kernel is queued on the current stream), and before dq is; the ring sends the finished dK/dV
    on from there, so that the transfer travels while dQ is computed.
    """
    which = resolve_backend(backend, q.device)
    if which == "triton":
        from ringflash.kernels.triton_bwd import triton_attn_bwd

        return triton_attn_bwd(
            do, q, k, v, o, lse, causal=causal, softmax_scale=softmax_scale, grad_dtype=grad_dtype,
            out=out, accumulate=accumulate, acc=acc, window=window, visibility=visibility, after_dkdv=after_dkdv,
        )
    summed = acc is not None or accumulate
    if out is not None or summed:  # before the work, as the Triton path checks
        check_grad_out(out, accumulate, q, k, grad_dtype or q.dtype, acc)
    if which == "reference":
        grads = ref_attn_bwd(
            do, q, k, v, o, lse, causal=causal, softmax_scale=softmax_scale,
            # Added to a sum (acc= or accumulate=): rounded after the sum, once, as on chip.
            grad_dtype=torch.float32 if summed else grad_dtype, window=window, visibility=visibility,
        )
    else:
        from ringflash.kernels.cudnn import cudnn_attn_bwd
        from ringflash.kernels.triton_passes import add_into

        grads = cudnn_attn_bwd(
            do, q, k, v, o, lse, causal=causal, softmax_scale=softmax_scale, window=window, visibility=visibility
        )
    if out is None and not summed:
        if after_dkdv is not None:
            after_dkdv()
        return tuple(g.to(grad_dtype or q.dtype) for g in grads)
    base = out if accumulate else (acc or (None, None, None))

    def write(i: int) -> None:
        if base[i] is None:
            out[i].copy_(grads[i])
        elif which == "cudnn":  # on CUDA: one pass, summed in float32 and rounded once
            add_into(base[i], grads[i], out[i])
        elif base[i] is out[i]:  # the ring's running sums: added in place
            out[i].add_(grads[i])
        else:
            out[i].copy_(base[i] + grads[i])

    write(1)
    write(2)
    if after_dkdv is not None:
        after_dkdv()
    write(0)
    return tuple(out)


from ringflash.kernels import ops  # noqa: E402, F401  (registers torch.ops.ringflash.attn_fwd / attn_bwd)
from ringflash.kernels.varlen import attn_varlen_bwd, attn_varlen_fwd  # noqa: E402  (uses attn_fwd/attn_bwd above)
