"""Tile loads and stores shared by the Triton kernels.

A tile is `rows × BLOCK_D` of a `(B, N, H, D)` tensor. Bounds checks are compile-time choices:
rows are checked only where a block can run past the sequence end (`CHECK_ROWS`), and the head
dim only when it is not a power of two (`HEAD_DIM < BLOCK_D`, e.g. 96), so the common case
compiles to unpredicated, vectorised accesses.
"""

import triton
import triton.language as tl


@triton.jit
def load_tile(ptrs, rows, offs_d, n_rows, CHECK_ROWS: tl.constexpr, HEAD_DIM: tl.constexpr,
              BLOCK_D: tl.constexpr):
    if CHECK_ROWS:
        if HEAD_DIM == BLOCK_D:
            tile = tl.load(ptrs, mask=rows[:, None] < n_rows, other=0.0)
        else:
            tile = tl.load(ptrs, mask=(rows[:, None] < n_rows) & (offs_d[None, :] < HEAD_DIM), other=0.0)
    else:
        if HEAD_DIM == BLOCK_D:
            tile = tl.load(ptrs)
        else:
            tile = tl.load(ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
    return tile


@triton.jit
def store_tile(ptrs, tile, rows, offs_d, n_rows, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    if HEAD_DIM == BLOCK_D:
        tl.store(ptrs, tile, mask=rows[:, None] < n_rows)
    else:
        tl.store(ptrs, tile, mask=(rows[:, None] < n_rows) & (offs_d[None, :] < HEAD_DIM))
