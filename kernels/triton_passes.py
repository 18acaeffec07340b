"""One-pass Triton kernels for what a backend's own kernels cannot fuse: merge and sum-and-round.

The Triton attention kernels merge a ring step into the running `(o, lse)` in their epilogue
(`attn_fwd(acc=)`) and add gradients to float32 sums on chip (`attn_bwd(acc=)`). cuDNN's kernels
(kernels/cudnn.py) write a fresh block result in the input dtype, so those steps are separate
passes there. In eager PyTorch each is a chain of 4–6 elementwise kernels with float32
temporaries; these do each in one read of the inputs and one write of the result:
- `merge_into(o_acc, lse_acc, o_blk, lse_blk, out)`: `kernels.ref_merge`'s math (the forward
  kernel's own `_merge_into`), o written to `out` in its dtype, lse to lse_acc;
- `add_into(acc, grad, out)`: `out = acc + grad`, added in float32 and rounded once to out's dtype.
All tensors `(B, N, H, D)` (lse `(B, H, N)`), any strides with a contiguous last dim, so the ring's
row-slice views go in as they are.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ringflash.kernels.launch_utils import bhnd_strides, block_d
from ringflash.kernels.tiles import load_tile, store_tile, tile_ptrs
from ringflash.kernels.triton_fwd import _merge_into

__all__ = ["add_into", "merge_into"]

_ROWS = 32  # rows of one head per program: 32 × 128 float32 is 16 KB, enough to keep loads in flight


@triton.jit
def _merge_kernel(
    OB, LB, OA, LA, O,
    stride_obb, stride_obn, stride_obh, stride_oab, stride_oan, stride_oah, stride_ob, stride_on, stride_oh,
    stride_lbb, stride_lbh, stride_lbn, stride_lab, stride_lah, stride_lan,
    H, N, HEAD_DIM: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
):
    off_b = tl.program_id(1) // H
    off_h = tl.program_id(1) % H
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    offs_d = tl.arange(0, BLOCK_D)
    o_blk = load_tile(tile_ptrs(OB, off_b, off_h, rows, offs_d, stride_obb, stride_obn, stride_obh), rows, offs_d, N,
                      True, HEAD_DIM, BLOCK_D).to(tl.float32)
    lse_blk = tl.load(LB + off_b * stride_lbb + off_h * stride_lbh + rows * stride_lbn, mask=rows < N,
                      other=float("-inf"))
    la_ptrs = LA + off_b * stride_lab + off_h * stride_lah + rows * stride_lan
    o, lse = _merge_into(o_blk, lse_blk, tile_ptrs(OA, off_b, off_h, rows, offs_d, stride_oab, stride_oan, stride_oah),
                         la_ptrs, rows, offs_d, N, HEAD_DIM, BLOCK_D)
    store_tile(tile_ptrs(O, off_b, off_h, rows, offs_d, stride_ob, stride_on, stride_oh), o.to(O.dtype.element_ty),
               rows, offs_d, N, HEAD_DIM, BLOCK_D)
    tl.store(la_ptrs, lse, mask=rows < N)


@triton.jit
def _add_kernel(
    A, G, O,
    stride_ab, stride_an, stride_ah, stride_gb, stride_gn, stride_gh, stride_ob, stride_on, stride_oh,
    H, N, HEAD_DIM: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
):
    off_b = tl.program_id(1) // H
    off_h = tl.program_id(1) % H
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    offs_d = tl.arange(0, BLOCK_D)
    a = load_tile(tile_ptrs(A, off_b, off_h, rows, offs_d, stride_ab, stride_an, stride_ah), rows, offs_d, N, True,
                  HEAD_DIM, BLOCK_D).to(tl.float32)
    g = load_tile(tile_ptrs(G, off_b, off_h, rows, offs_d, stride_gb, stride_gn, stride_gh), rows, offs_d, N, True,
                  HEAD_DIM, BLOCK_D).to(tl.float32)
    total = (a + g).to(O.dtype.element_ty)
    store_tile(tile_ptrs(O, off_b, off_h, rows, offs_d, stride_ob, stride_on, stride_oh), total, rows, offs_d, N,
               HEAD_DIM, BLOCK_D)


def _grid(t: torch.Tensor) -> tuple[int, int]:
    B, N, H, _ = t.shape
    return triton.cdiv(N, _ROWS), B * H


def merge_into(
    o_acc: torch.Tensor, lse_acc: torch.Tensor, o_blk: torch.Tensor, lse_blk: torch.Tensor, out: torch.Tensor
) -> None:
    """`(out, lse_acc)` = the merge of `(o_acc, lse_acc)` with `(o_blk, lse_blk)`, in float32, exactly as
    `kernels.ref_merge` (out may be o_acc itself). Shapes and dtypes are the caller's to check."""
    B, N, H, D = o_acc.shape
    if N == 0 or B * H == 0:
        return
    _merge_kernel[_grid(o_acc)](
        o_blk, lse_blk, o_acc, lse_acc, out, *bhnd_strides(o_blk), *bhnd_strides(o_acc), *bhnd_strides(out),
        *lse_blk.stride(), *lse_acc.stride(), H, N, HEAD_DIM=D, ROWS=_ROWS, BLOCK_D=block_d(D),
    )


def add_into(acc: torch.Tensor, grad: torch.Tensor, out: torch.Tensor) -> None:
    """`out = acc + grad`, summed in float32 and rounded once to out's dtype (out may be acc)."""
    B, N, H, D = acc.shape
    if N == 0 or B * H == 0:
        return
    _add_kernel[_grid(acc)](
        acc, grad, out, *bhnd_strides(acc), *bhnd_strides(grad), *bhnd_strides(out), H, N, HEAD_DIM=D, ROWS=_ROWS,
        BLOCK_D=block_d(D),
    )
