"""Public entry points: `ring_flash_attn_func` and the `RingFlashAttention` module.

Shaped like `flash_attn_func`: `(B, N, H, D)` tensors, `causal` and `softmax_scale` arguments,
optional LSE. q, k, v are this rank's shard of the sequence, cut by `ringflash.layout.shard`
with the same `layout` (and position ids from `global_positions`).
"""

from __future__ import annotations

import struct

import torch
import torch.distributed as dist
from torch import nn

import kernels
from kernels.checks import SUPPORTED_DTYPES, check_qkv, resolve_scale
from ringflash.comm import RingComm
from ringflash.layout import LAYOUTS, check_layout, check_splittable
from ringflash.ring import RingFlashAttnFunc

__all__ = ["RingFlashAttention", "ring_flash_attn_func"]

# Fields of the per-call signature every rank must agree on, with how many ints each takes.
_FIELDS = (("q.shape", 4), ("k.shape", 4), ("dtype", 1), ("layout", 1), ("causal", 1), ("softmax_scale", 1))


def _check_local(q, k, v, causal, softmax_scale, layout, backend, world) -> float:
    """This rank's own checks; raises TypeError/ValueError naming the argument. Returns the scale."""
    check_qkv(q, k, v, causal=False)
    if k.shape[1] != q.shape[1]:
        raise ValueError(
            f"k.shape[1] (local seqlen) must equal q.shape[1] = {q.shape[1]}, got {k.shape[1]}: "
            "ring attention shards queries and keys alike"
        )
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    check_layout(layout)
    try:
        check_splittable(q.shape[1] * world, world, layout)
    except ValueError as e:
        raise ValueError(f"q.shape[1] = {q.shape[1]} local tokens on each of {world} ranks: {e}") from None
    kernels.resolve_backend(backend, q.device)
    return resolve_scale(softmax_scale, q.shape[-1])


def _signature(ok, q, k, causal, scale, layout) -> list[int]:
    def shape(t):
        return list(t.shape) if isinstance(t, torch.Tensor) and t.dim() == 4 else [-1] * 4

    dtype = getattr(q, "dtype", None)
    return [
        int(ok),
        *shape(q),
        *shape(k),
        SUPPORTED_DTYPES.index(dtype) if dtype in SUPPORTED_DTYPES else -1,
        LAYOUTS.index(layout) if layout in LAYOUTS else -1,
        int(bool(causal)),
        struct.unpack("<q", struct.pack("<d", scale))[0] if scale is not None else -1,  # exact bits
    ]


def _check_across_ranks(comm: RingComm, rows_of_self: list[int], device) -> None:
    rows = comm.all_gather_ints(rows_of_self, device)
    failed = [r for r, row in enumerate(rows) if row[0] == 0]
    if failed:
        raise ValueError(
            f"ring attention: rank(s) {failed} of the group rejected their inputs (see the "
            "error raised there); every rank raises so that none waits for them"
        )
    i = 1
    for name, width in _FIELDS:
        vals = [tuple(row[i : i + width]) for row in rows]
        if len(set(vals)) > 1:
            if name == "dtype":
                vals = [str(SUPPORTED_DTYPES[v[0]]) for v in vals]
            elif name == "layout":
                vals = [LAYOUTS[v[0]] for v in vals]
            elif name == "softmax_scale":
                vals = [struct.unpack("<d", struct.pack("<q", v[0]))[0] for v in vals]
            elif width == 1:
                vals = [v[0] for v in vals]
            raise ValueError(
                f"ring attention inputs differ between the ranks of the group: {name} is "
                + ", ".join(f"{v} on rank {r}" for r, v in enumerate(vals))
            )
        i += width


def ring_flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    softmax_scale: float | None = None,
    group: dist.ProcessGroup | None = None,
    layout: str = "zigzag",
    return_lse: bool = False,
    backend: str | None = None,
    check_ranks: bool = True,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Exact attention over a sequence sharded across the ranks of `group`.

    Args:
        q: `(B, N_local, H, D)`, this rank's queries; fp16, bf16 or fp32.
        k, v: `(B, N_local, Hkv, D)`, same dtype and device, `H % Hkv == 0` (GQA/MQA).
        causal: mask by *global* position (the layout's order), as on the unsharded sequence.
        softmax_scale: default `1/sqrt(D)`.
        group: the context-parallel process group; None = the default group if torch.distributed
            is initialised, else this process alone. One rank makes it a single local kernel call.
        layout: `"zigzag"` (balances causal work; needs N_local even) or `"contiguous"`; must be the
            layout the inputs were sharded with.
        return_lse: also return `lse (B, H, N_local)` float32, natural log, over the whole sequence
            (not differentiable).
        backend: kernel backend for `kernels.attn_fwd/attn_bwd` (None: Triton on CUDA, reference on CPU).
        check_ranks: see below.

    Returns `o (B, N_local, H, D)` in q's dtype (and `lse`). Gradients flow to q, k, v in their dtype.

    Communication: NCCL for CUDA tensors; gloo with CPU tensors, or with CUDA tensors staged
    through pinned host memory (several ranks sharing one GPU). See ringflash/comm.py.

    Cross-rank check: before the ring starts, every rank all-gathers a 13-int64 signature (whether
    its own inputs passed validation, q and k shapes, dtype, layout, causal, softmax_scale). If any
    rank rejected its inputs or the signatures differ, every rank raises ValueError, naming the
    field and each rank's value, instead of hanging in a transfer of the wrong size. Cost: one
    tiny all_gather per call (tens of microseconds on NCCL, about a round trip on gloo) and, on an
    NCCL-only group, one host synchronisation to read it, outside the ring loop. `check_ranks=False`
    skips it; do that only where every rank's shapes are guaranteed equal by construction (e.g. a
    training loop with fixed shapes) and the host sync matters, because a mismatch then fails in
    the transfers (or at the group timeout) rather than with a clear message.
    """
    comm = RingComm(group)
    try:
        scale = _check_local(q, k, v, causal, softmax_scale, layout, backend, comm.world)
        error = None
    except (TypeError, ValueError) as e:
        scale, error = None, e
    if comm.world > 1 and check_ranks:
        device = q.device if isinstance(q, torch.Tensor) else None
        sig = _signature(error is None, q, k, causal, scale, layout)
        if error is not None:
            # Tell the others first (they are waiting in the same all_gather), then raise ours.
            comm.all_gather_ints(sig, device)
            raise error
        _check_across_ranks(comm, sig, device)
    elif error is not None:
        raise error
    o, lse = RingFlashAttnFunc.apply(q, k, v, causal, scale, layout, comm, backend)
    return (o, lse) if return_lse else o


class RingFlashAttention(nn.Module):
    """`ring_flash_attn_func` as a module with fixed settings: `forward(q, k, v) -> o`.

    q `(B, N_local, H, D)`, k, v `(B, N_local, Hkv, D)`; o like q. Causal by default (language
    models). With no group and no torch.distributed it is plain single-device attention, so a
    model can hold it unconditionally.
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        layout: str = "zigzag",
        causal: bool = True,
        softmax_scale: float | None = None,
        backend: str | None = None,
        check_ranks: bool = True,
    ):
        super().__init__()
        check_layout(layout)
        if backend is not None and backend not in kernels.BACKENDS:
            raise ValueError(f"backend must be one of {kernels.BACKENDS} or None, got {backend!r}")
        self.group, self.layout, self.causal = group, layout, causal
        self.softmax_scale, self.backend, self.check_ranks = softmax_scale, backend, check_ranks

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return ring_flash_attn_func(
            q,
            k,
            v,
            causal=self.causal,
            softmax_scale=self.softmax_scale,
            group=self.group,
            layout=self.layout,
            backend=self.backend,
            check_ranks=self.check_ranks,
        )

    def extra_repr(self) -> str:
        return f"layout={self.layout!r}, causal={self.causal}, backend={self.backend!r}"
