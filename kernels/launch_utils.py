"""Host-side helpers shared by the forward and backward Triton launchers."""

from __future__ import annotations

import functools
import os

import torch
import triton

from ringflash.kernels.checks import interpreting
from ringflash.kernels.tuning import Tile, autotuning, tile_for

try:  # Triton >= 3.3; without it the kernels load every tile through pointers
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover
    TensorDescriptor = None

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


@functools.cache
def num_sms(device: torch.device) -> int:
    """The device's SM count, which sets how many heads a grid sweeps at a time (kernels/tiles.py
    `heaviest_first`); on CPU (the interpreter) an H100's, so the tests cover the same orders."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


def bhnd_strides(t: torch.Tensor) -> tuple[int, int, int]:
    """(batch, seq, head) strides of a `(B, N, H, D)` tensor whose last dim is contiguous."""
    return t.stride(0), t.stride(1), t.stride(2)


def tma_ok(*ts: torch.Tensor) -> bool:
    """Whether the kernels may load these `(B, N, H, D)` tensors through tensor descriptors.

    A descriptor (TMA on Hopper) sees the tensor as `(B, N, H·D)` and loads a tile of one head's
    rows with one instruction instead of per-thread address arithmetic. It needs: Hopper or newer
    (or the interpreter, so the CPU tests run this path), 16-bit inputs (the measured case;
    float32 keeps the pointer loads), heads packed along the last two dims, head dims that are
    their own blocks (`block_d`: no masked columns), 16-byte aligned rows and base, and rows to load.
    `RINGFLASH_TMA=0` turns it off.
    """
    if TensorDescriptor is None or os.environ.get("RINGFLASH_TMA", "1") == "0":
        return False
    if not interpreting() and not (ts[0].is_cuda and _hopper_or_newer(ts[0].device)):
        return False
    return all(_descriptor_fits(t) for t in ts)


@functools.cache
def _hopper_or_newer(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device)[0] >= 9


def _descriptor_fits(t: torch.Tensor) -> bool:
    packed = t.stride(3) == 1 and t.stride(2) == t.shape[3] == block_d(t.shape[3])
    aligned = t.data_ptr() % 16 == 0 and all(s > 0 and s * t.element_size() % 16 == 0 for s in _row_strides(t))
    return t.element_size() == 2 and packed and aligned and t.shape[1] > 0


def _row_strides(t: torch.Tensor) -> tuple[int, int]:
    """(batch, position) strides for a descriptor; a lone batch's stride is never used, so any valid one."""
    return t.stride(0) if t.shape[0] > 1 else t.shape[1] * t.stride(1), t.stride(1)


def row_descriptor(t: torch.Tensor, rows: int) -> TensorDescriptor:
    """`t (B, N, H, D)` as a `(B, N, H·D)` descriptor whose tile is `rows` positions of one head.

    Load it at `[b, first_row, head·D]`; rows past N read as zeros, like a row-masked load.
    """
    B, N, H, D = t.shape
    return TensorDescriptor(t, [B, N, H * D], [*_row_strides(t), 1], [1, rows, D])


def kernel_inputs(kernel: str, tensors: tuple[torch.Tensor, ...], tile: Tile | None,
                  block_d: int) -> tuple[tuple, Tile | None, bool]:
    """One kernel's `(q, k, v[, do])` arguments, its tile and its TMA flag; `block_d` the larger
    of the kernel's two head dims' blocks (q·k's and v's), which sizes its tiles.

    Descriptors sized for the kernel's tile (from `tile_for`, with q's heads per K/V head and length) where
    `tma_ok`, else the tensors themselves. A descriptor serves one tile shape, so there are none
    while autotuning picks among several.
    """
    if (tile is None and autotuning()) or not tma_ok(*tensors):
        return tensors, tile, False
    q, k = tensors[:2]
    tile = tile or tile_for(kernel, block_d, descriptors=True, group=q.shape[2] // k.shape[2], queries=q.shape[1])
    q_rows, kv_rows = (tile[1], tile[0]) if kernel == "dkdv" else (tile[0], tile[1])
    rows = (q_rows, kv_rows, kv_rows, q_rows)
    return tuple(row_descriptor(t, n) for t, n in zip(tensors, rows)), tile, True
