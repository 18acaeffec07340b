"""Input validation shared by the Triton kernels and the PyTorch reference.

Every public kernel entry point calls these first, so a bad call fails the same way
whichever backend runs it, with a message that names the argument. `interpreting()` lives here,
in a module that imports no other kernel module, so every kernel module can ask it.
"""

from __future__ import annotations

import math
import os

import torch

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256


def interpreting() -> bool:
    """Whether Triton runs in its interpreter (TRITON_INTERPRET=1): the kernels' CPU path."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Check q `(B, Nq, H, D)`, k `(B, Nk, Hkv, D)` and v `(B, Nk, Hkv, Dv)` against the kernel
    contract: v's head dim may differ from q's and k's (DeepSeek's MLA: 192 and 128)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must have 4 dims (batch, seqlen, heads, head_dim), got shape {tuple(t.shape)}")
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{name} must be float16, bfloat16 or float32, got {t.dtype}")
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dim (stride 1), got strides {t.stride()}")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise TypeError(f"{name}.dtype must equal q.dtype ({q.dtype}), got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name} must be on q's device ({q.device}), got {t.device}")
    B, _, H, D = q.shape
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(
            f"v.shape[:3] (batch, seqlen, heads) must equal k's {tuple(k.shape[:3])}, got v {tuple(v.shape)}"
        )
    Bk, _, Hkv, Dk = k.shape
    if Bk != B:
        raise ValueError(f"k.shape[0] (batch) must equal q.shape[0] = {B}, got {Bk}")
    if Dk != D:
        raise ValueError(f"k.shape[3] (head_dim) must equal q.shape[3] = {D}, got {Dk}")
    if not 1 <= D <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be in [1, {MAX_HEAD_DIM}], got {D}")
    if not 1 <= v.shape[3] <= MAX_HEAD_DIM:
        raise ValueError(f"v.shape[3] (value head_dim) must be in [1, {MAX_HEAD_DIM}], got {v.shape[3]}")
    if Hkv == 0 or H % Hkv != 0:
        raise ValueError(
            f"the number of query heads (q.shape[2] = {H}) must be a multiple of the number of "
            f"key/value heads (k.shape[2] = {Hkv})"
        )


def out_shape(q: torch.Tensor, v: torch.Tensor) -> tuple[int, int, int, int]:
    """`(B, Nq, H, Dv)`: the shape of o (and of do) for q `(B, Nq, H, D)` and v `(B, Nk, Hkv, Dv)`."""
    return (*q.shape[:3], v.shape[3])


def check_bwd(
    do: torch.Tensor, q: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor
) -> None:
    """Check the backward's extra inputs: `do` and `o` shaped `(B, Nq, H, Dv)` (`out_shape`),
    `lse (B, H, Nq)` float32."""
    for name, t in (("do", do), ("o", o)):
        _check_like_o(name, t, q, v)
    B, Nq, H, _ = q.shape
    if not isinstance(lse, torch.Tensor):
        raise TypeError(f"lse must be a torch.Tensor, got {type(lse).__name__}")
    if lse.shape != (B, H, Nq):
        raise ValueError(f"lse must have shape (batch, heads, seqlen_q) = {(B, H, Nq)}, got {tuple(lse.shape)}")
    if lse.dtype != torch.float32:
        raise TypeError(f"lse must be float32, got {lse.dtype}")
    if lse.device != q.device:
        raise ValueError(f"lse must be on q's device ({q.device}), got {lse.device}")


def check_grad_out(
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
    accumulate: bool,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    grad_dtype: torch.dtype,
    acc: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Check the backward's optional output buffers `out = (dq, dk, dv)`: q's, k's and v's shapes,
    `grad_dtype`, q's device, contiguous last dim (views of larger tensors are fine); and the
    sums `acc = (dq_acc, dk_acc, dv_acc)` to add to: the same, in float32 (running sums, which may
    be `out` itself), or in q's dtype where they are one rounded block result (cuDNN's, which float32
    would hold unchanged) that is only read."""
    if accumulate and acc is not None:
        raise ValueError("give accumulate=True (add to out) or acc= (add to acc, write to out), not both")
    if out is None:
        if accumulate:
            raise ValueError("accumulate=True needs out=(dq, dk, dv): the buffers to add into")
        if acc is not None:
            raise ValueError("acc= needs out=(dq, dk, dv): the buffers to write the sums into")
        return
    _check_grads("out", out, (q, k, v), (grad_dtype,), f"have the gradient dtype {grad_dtype}")
    if acc is not None:
        rule = "be float32 (running sums)" + _or_q_dtype(q, "only read")
        _check_grads("acc", acc, (q, k, v), (torch.float32, q.dtype), rule)
        for name, a, o in zip(("dq", "dk", "dv"), acc, out):
            if a.dtype != torch.float32 and aliases(a, o):
                raise ValueError(f"acc {name} in {a.dtype} is only read: summing into it in place (out {name} "
                                 "is the same memory) needs float32 sums")


def _check_grads(
    what: str, ts: tuple[torch.Tensor, torch.Tensor, torch.Tensor], qkv: tuple[torch.Tensor, ...],
    dtypes: tuple[torch.dtype, ...], dtype_rule: str,
) -> None:
    if not isinstance(ts, (tuple, list)) or len(ts) != 3:
        raise TypeError(f"{what} must be a tuple (dq, dk, dv) of tensors, got {type(ts).__name__}")
    q = qkv[0]
    for name, t, like in zip(("dq", "dk", "dv"), ts, qkv):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{what} {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.shape != like.shape:
            raise ValueError(f"{what} {name} must have shape {tuple(like.shape)}, got {tuple(t.shape)}")
        if t.dtype not in dtypes:
            raise TypeError(f"{what} {name} must {dtype_rule}, got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{what} {name} must be on q's device ({q.device}), got {t.device}")
        if t.stride(-1) != 1:
            raise ValueError(f"{what} {name} must have a contiguous last dim (stride 1), got strides {t.stride()}")


def aliases(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors start at the same memory (an in-place write into one changes the other)."""
    return a.numel() > 0 and a.data_ptr() == b.data_ptr()


def _or_q_dtype(q: torch.Tensor, when: str) -> str:
    """The error text's second choice of dtype, where q's is another than float32."""
    return "" if q.dtype == torch.float32 else f", or q's dtype {q.dtype} ({when})"


def check_acc(
    acc: tuple[torch.Tensor, torch.Tensor],
    q: torch.Tensor,
    v: torch.Tensor,
    out_dtype: torch.dtype | None = None,
    read_only: bool = False,
) -> None:
    """Check the forward's running accumulator `acc = (o_acc, lse_acc)`: float32 `(B, Nq, H, Dv)`
    with a contiguous last dim and float32 `(B, H, Nq)`, on q's device (views are fine).
    `read_only` (the merged o goes to `out=`, other memory): o_acc may also be in q's dtype, one
    backend's rounded result (cuDNN's), which a float32 copy would hold unchanged."""
    if not isinstance(acc, (tuple, list)) or len(acc) != 2:
        raise TypeError(f"acc must be a tuple (o_acc, lse_acc) of tensors, got {type(acc).__name__}")
    B, Nq, H, _ = q.shape
    for name, t, shape in (("o_acc", acc[0], out_shape(q, v)), ("lse_acc", acc[1], (B, H, Nq))):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"acc {name} must be a torch.Tensor, got {type(t).__name__}")
        if tuple(t.shape) != shape:
            raise ValueError(f"acc {name} must have shape {shape}, got {tuple(t.shape)}")
        if t.dtype != torch.float32 and not (name == "o_acc" and read_only and t.dtype == q.dtype):
            rule = _or_q_dtype(q, "with out= elsewhere, then only read") if name == "o_acc" else ""
            raise TypeError(f"acc {name} must be float32 (the merge accumulates in float32){rule}, got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"acc {name} must be on q's device ({q.device}), got {t.device}")
    if acc[0].stride(-1) != 1:
        raise ValueError(f"acc o_acc must have a contiguous last dim (stride 1), got strides {acc[0].stride()}")
    if out_dtype not in (None, torch.float32):
        raise ValueError(f"out_dtype must be None or float32 with acc= (the accumulator is float32), got {out_dtype}")


def check_fwd_out(out: torch.Tensor, q: torch.Tensor, v: torch.Tensor) -> None:
    """Check the forward's optional output buffer `out`: shape `(B, Nq, H, Dv)` (`out_shape`), q's
    device, a supported dtype, a contiguous last dim (a view of a larger tensor is fine)."""
    _check_like_o("out", out, q, v)


def _check_like_o(name: str, t: torch.Tensor, q: torch.Tensor, v: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if tuple(t.shape) != out_shape(q, v):
        raise ValueError(f"{name} must have shape (B, Nq, H, Dv) = {out_shape(q, v)}, got {tuple(t.shape)}")
    if t.device != q.device:
        raise ValueError(f"{name} must be on q's device ({q.device}), got {t.device}")
    if t.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{name} must be float16, bfloat16 or float32, got {t.dtype}")
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must have a contiguous last dim (stride 1), got strides {t.stride()}")


def resolve_fwd_outputs(
    q: torch.Tensor, v: torch.Tensor, out_dtype: torch.dtype | None, acc: tuple[torch.Tensor, torch.Tensor] | None,
    out: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Where the forward writes `(o, lse)`, checked: o to `out`, else o_acc, else a new `(B, Nq, H, Dv)`
    tensor in `out_dtype` (default q's); lse to lse_acc, else a new float32 `(B, H, Nq)`."""
    if acc is not None:
        read_only = out is not None and not aliases(out, acc[0])
        check_acc(acc, q, v, None if out is not None else out_dtype, read_only)
    if out is not None:
        check_fwd_out(out, q, v)
        if out_dtype not in (None, out.dtype):
            raise ValueError(f"out_dtype {out_dtype} differs from out's dtype {out.dtype}; give one of them")
    B, Nq, H, _ = q.shape
    if out is None:
        out = acc[0] if acc is not None else torch.empty(out_shape(q, v), dtype=out_dtype or q.dtype, device=q.device)
    lse = acc[1] if acc is not None else torch.empty((B, H, Nq), dtype=torch.float32, device=q.device)
    return out, lse


def resolve_scale(softmax_scale: float | None, head_dim: int) -> float:
    """`softmax_scale` or the default `1/sqrt(head_dim)`; rejects non-positive or non-finite values."""
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    scale = float(softmax_scale)
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"softmax_scale must be a positive finite number, got {softmax_scale!r}")
    return scale
