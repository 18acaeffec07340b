"""cuDNN's fused attention behind the kernel contract: the opt-in `backend="cudnn"`.

NVIDIA's cuDNN kernels, which PyTorch ships and calls for SDPA, run attention faster than our
Triton kernels on Hopper, the backward most (`benchmarks/kernels.jsonl`). This backend calls the
same cuDNN op as SDPA
(`aten._scaled_dot_product_cudnn_attention` and its backward) on views of our `(B, N, H, D)`
tensors, with `(o, lse)` in and out as the contract wants, so the ring can run its steps on them.

What differs from the Triton backend:
- Causal and full attention only: the op takes no per-row key intervals, so windows and document
  masks raise, and so does a value head dim other than q's (not claimed: untested here). float16
  and bfloat16 only, on an sm80+ GPU, with cuDNN ≥ 9, head dims that are multiples of 8 up to 128
  (256 on Hopper with cuDNN ≥ 9.10): checked here (`check_cudnn`), with errors that name
  the argument, rather than left to fail inside cuDNN.
- A block's o and gradients come out of cuDNN rounded to the input dtype, whatever `out_dtype` or
  `grad_dtype` asks for. With `acc=` or `accumulate=` they are then merged into the float32
  accumulator or added to the float32 sums in a separate pass (where the Triton kernels do it on
  chip, unrounded), so a ring combines per-step results that were each rounded once, as torch's
  `context_parallel` does. (Both passes are one Triton kernel each, kernels/triton_passes.py.)
  Where a partial result is only read once more, the ring keeps it in the input dtype
  (`kernels.partial_dtype`): in float32 it would hold the same values at twice the bytes.
- Not deterministic: refused under `torch.use_deterministic_algorithms(True)`, as SDPA's own
  dispatcher avoids cuDNN there (the Triton backward is bit-deterministic).
"""

from __future__ import annotations

import functools

import torch

from ringflash.kernels.checks import check_bwd, check_qkv, resolve_fwd_outputs, resolve_scale
from ringflash.kernels.spec import AttnSpec
from ringflash.kernels.triton_passes import merge_into

__all__ = ["check_cudnn", "cudnn_attn_bwd", "cudnn_attn_fwd"]

_aten = torch.ops.aten


MASKS_NEED_TRITON = (
    "backend='cudnn' runs causal or full attention only: windows and document masks (window=, "
    "mask=, cu_seqlens, intervals) need backend='triton'"
)


def cudnn_limits(kind: str | None, dtype: torch.dtype | None, head_dim: int | None,
                 device: torch.device | None = None) -> str | None:
    """Why cuDNN cannot run this (a message naming the argument), or None: the backend's
    `supports`. Any argument may be None (not known yet: not checked). cuDNN's own limits as
    PyTorch's SDPA checks them (`sdp_utils.cpp`), since this calls the op directly."""
    if kind is not None and kind not in ("full", "causal"):
        return MASKS_NEED_TRITON
    if dtype is not None and dtype not in (torch.float16, torch.bfloat16):
        return f"backend='cudnn' takes float16 or bfloat16 inputs, got {dtype}"
    if head_dim is not None and head_dim % 8:
        return f"backend='cudnn' needs q.shape[3] (head_dim) a multiple of 8, got {head_dim}"
    if device is not None and device.type == "cuda" and head_dim is not None:
        max_d = _max_head_dim(device)
        if head_dim > max_d:
            return (f"backend='cudnn' needs q.shape[3] (head_dim) a multiple of 8 up to {max_d} on this GPU, "
                    f"got {head_dim}")
    return None


def check_cudnn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttnSpec | None = None) -> None:
    """Reject what the cuDNN backend cannot run, before any work, naming the argument."""
    if v.shape[-1] != q.shape[-1]:
        raise ValueError(
            f"backend='cudnn' needs v.shape[3] (value head_dim) equal to q.shape[3] = {q.shape[-1]}, got "
            f"{v.shape[-1]}; use 'triton' or 'auto'"
        )
    if spec is not None and spec.softcap:
        raise ValueError(f"softcap={spec.softcap}: backend='cudnn' has no logit softcapping; use 'triton' or 'auto'")
    if spec is not None and not spec.dense:
        raise ValueError(MASKS_NEED_TRITON)
    why = cudnn_limits(None, q.dtype, None)
    if why is not None:
        raise TypeError(why)
    if q.device.type != "cuda":
        raise ValueError(f"backend='cudnn' needs CUDA tensors, got q on {q.device}")
    why = cudnn_limits(None, None, q.shape[-1], q.device)
    if why is not None:
        raise ValueError(why)
    if q.shape[0] > 65535 or max(q.shape[2], k.shape[2]) > 65535:
        raise ValueError(f"backend='cudnn' takes at most 65535 batches and heads, got q {tuple(q.shape)}")
    if torch.are_deterministic_algorithms_enabled():
        raise ValueError(
            "backend='cudnn' is not deterministic and torch.use_deterministic_algorithms(True) is on: use "
            "backend='triton', whose gradients are bit-deterministic"
        )


@functools.cache  # per device: every ring step checks its call, the device's answer never changes
def _max_head_dim(device: torch.device) -> int:
    """The largest head dim cuDNN takes on `device`; raises if cuDNN cannot run there at all."""
    version = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    if version is None or version < 90000:
        raise ValueError(f"backend='cudnn' needs cuDNN 9 or newer; this PyTorch has {version}")
    capability = torch.cuda.get_device_capability(device)
    if capability < (8, 0):
        raise ValueError(f"backend='cudnn' needs an sm80+ GPU (Ampere or newer), got sm{capability[0]}{capability[1]}")
    return 256 if capability[0] == 9 and version >= 91000 else 128


@functools.cache
def _lse_dims() -> int:
    """How this PyTorch's cuDNN op shapes lse: `(B, H, N, 1)` (4) or `(B, H, N)` (3), from its meta
    kernel (shapes only, no GPU work); the backward must be given the same."""
    m = torch.empty(1, 1, 8, 64, device="meta", dtype=torch.bfloat16)
    return _aten._scaled_dot_product_cudnn_attention(m, m, m, None, True, 0.0, False, False)[1].dim()


def _heads_first(t: torch.Tensor) -> torch.Tensor:
    # (B, N, H, D) -> (B, H, N, D) as a view: cuDNN takes any strides, so nothing is copied.
    return t.transpose(1, 2)


def _empty(q: torch.Tensor, k: torch.Tensor) -> bool:
    """No (query, key) pair: cuDNN is not called (o = 0, lse = -inf; zero gradients)."""
    return q.shape[1] == 0 or k.shape[1] == 0 or q.shape[0] * q.shape[2] == 0


def cudnn_attn_fwd(
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
    """`Backend.fwd_step` on cuDNN: same arguments and results (see the module docstring)."""
    check_qkv(q, k, v)
    check_cudnn(q, k, v, spec)
    spec.intervals_for(q, k)  # the diagonal check
    causal = spec.causal
    # cuDNN's own o and lse are the result unless they are to go elsewhere: no copy.
    own = acc is None and out is None and out_dtype in (None, q.dtype)
    o_out, lse_out = (None, None) if own else resolve_fwd_outputs(q, v, out_dtype, acc, out)
    scale = resolve_scale(softmax_scale, q.shape[-1])
    B, Nq, H, _ = q.shape
    if _empty(q, k):
        o, lse = q.new_zeros(q.shape), torch.full((B, H, Nq), float("-inf"), device=q.device)
    else:
        o, lse = _aten._scaled_dot_product_cudnn_attention(
            _heads_first(q), _heads_first(k), _heads_first(v), None, True, 0.0, causal, False, scale=scale
        )[:2]
        o, lse = _heads_first(o), lse.view(B, H, Nq)  # lse comes as (B, H, Nq) or (B, H, Nq, 1)
    if own:  # contiguous as the other backends' (cuDNN's o has q's stride order: a no-op for most q)
        return o.contiguous(), lse
    if acc is None:
        lse_out.copy_(lse)
        return o_out.copy_(o), lse_out
    merge_into(acc[0], lse_out, o, lse, o_out)
    return o_out, lse_out


def cudnn_attn_bwd(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    spec: AttnSpec,
    softmax_scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients `(dq, dk, dv)` in the input dtype, from cuDNN, shaped like q, k, v (views).

    `o`, `lse` may be global (a ring's merged ones): cuDNN recomputes P from lse and
    rowsum(do·o) from o, as the Triton kernels do, so per-block gradients sum to the full ones.
    """
    check_qkv(q, k, v)
    check_cudnn(q, k, v, spec)
    spec.intervals_for(q, k)
    causal = spec.causal
    check_bwd(do, q, v, o, lse)
    scale = resolve_scale(softmax_scale, q.shape[-1])
    if _empty(q, k):
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    if o.dtype != q.dtype:  # cuDNN reads o in the inputs' dtype (only rowsum(do·o) needs it)
        o = o.to(q.dtype)
    if do.dtype != q.dtype:
        do = do.to(q.dtype)
    # cuDNN wants do laid out like o.
    if do.stride() != o.stride():
        do, o = do.contiguous(), o.contiguous()
    none = torch.empty((), dtype=torch.long, device=q.device)  # dropout's RNG state: unused at p = 0
    lse = lse.contiguous().view(*lse.shape, *(1,) * (_lse_dims() - 3))
    grads = _aten._scaled_dot_product_cudnn_attention_backward(
        *map(_heads_first, (do, q, k, v, o)), lse, none, none, None, None, None, q.shape[1], k.shape[1], 0.0, causal,
        scale=scale,
    )
    return tuple(_heads_first(g) for g in grads)
