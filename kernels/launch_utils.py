"""Host-side helpers shared by the forward and backward Triton launchers."""

from __future__ import annotations

import torch
import triton

from kernels import interpreting

LOG2E = 1.4426950408889634  # 1/ln 2: scores are scaled by softmax_scale·log2(e) so the kernels use exp2


def upcast_dots(dtype: torch.dtype) -> bool:
    """The interpreter computes `tl.dot` on bf16's raw bits (numpy has no bf16): upcast there."""
    return interpreting() and dtype == torch.bfloat16


def dot_precision(dtype: torch.dtype) -> str:
    """float32 inputs are computed in true fp32 ("ieee"); the user asked for fp32, not tf32."""
    return "ieee" if dtype == torch.float32 else "tf32"


def block_d(head_dim: int) -> int:
    """Head dims that are not powers of two (96, ...) run in the next power of two, masked."""
    return max(16, triton.next_power_of_2(head_dim))


def bhnd_strides(t: torch.Tensor) -> tuple[int, int, int]:
    """(batch, seq, head) strides of a `(B, N, H, D)` tensor whose last dim is contiguous."""
    return t.stride(0), t.stride(1), t.stride(2)
