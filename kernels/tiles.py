"""Tile loads and stores shared by the Triton kernels.

A tile is `rows × BLOCK_D` of a `(B, N, H, D)` tensor. Bounds checks are compile-time choices:
rows are checked only where a block can run past the sequence end (`CHECK_ROWS`), and the head
dim only when it is not a power of two (`HEAD_DIM < BLOCK_D`, e.g. 96), so the common case
compiles to unpredicated, vectorised accesses.

`head_rows(src, ...)` loads a tile of one head's rows either way the kernels read their inputs:
through a tensor descriptor (TMA, one instruction per tile; kernels/launch_utils.py says when)
or through pointers; `head_base` gives the `src` it expects.

`heaviest_first` says which tile and head a program of the `(tiles, B·H)` grid works on.

`block_bounds` turns a block of rows' visible intervals (kernels/masks.py) into loop bounds;
`visible_keys` is the mask the forward and the dQ pass apply inside masked blocks.
"""

import triton
import triton.language as tl


@triton.jit
def heaviest_first(n_sms):
    """`(i, bh)`: this program's tile as a rank in launch order (0 = first) and its batch·head.

    The GPU starts programs in launch order (axis 0 fastest), and each kernel maps rank 0 to its
    heaviest tile: under a causal mask tiles differ in work up to N/BLOCK times. One head at a
    time, a grid with few tiles per head leaves the last head's heavy tiles to start when the
    grid is nearly done and run alone: an exposed tail. So ranks sweep several heads at a time,
    the fewest (a power of two) whose tiles fill the `n_sms` SMs (4 at 4k, 2 at 8k, 1 from 16k
    on, with 128-row tiles): more would only split the L2 between heads (at 32k, 4 heads' Q and
    dO ask the 50 MB L2 for 64 MB).
    """
    n_tiles = tl.num_programs(0)
    fit = tl.maximum(n_sms // n_tiles, 1)
    sweep = 1
    for _ in tl.static_range(6):  # the largest power of two <= fit, up to 64
        sweep = tl.where(sweep * 2 <= fit, sweep * 2, sweep)
    pid = tl.program_id(1) * n_tiles + tl.program_id(0)  # the launch order
    first_bh = (pid // (sweep * n_tiles)) * sweep
    heads = tl.minimum(sweep, tl.num_programs(1) - first_bh)  # fewer in the last sweep
    within = pid - first_bh * n_tiles
    return within // heads, first_bh + within % heads


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
def head_base(X, off_b, off_h, stride_b, stride_h, TMA: tl.constexpr):
    """What `head_rows` loads head `off_h` of batch `off_b` from: X itself if it is a `(B, N, H·D)`
    descriptor (TMA), else the head's first element."""
    if TMA:
        return X
    else:
        return X + off_b * stride_b + off_h * stride_h


@triton.jit
def head_rows(src, stride_n, off_b, start, col, offs_d, n_rows, CHECK_ROWS: tl.constexpr, TMA: tl.constexpr,
              ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """Rows `[start, start + ROWS)` of one head, `(ROWS, BLOCK_D)`; rows past `n_rows` read as zeros.

    `src` from `head_base`: a descriptor, loaded at `[off_b, start, col]` with `col` the head's
    first column (TMA), or the head's base pointer with row stride `stride_n`, checked against
    `n_rows` only if CHECK_ROWS (a descriptor always is).
    """
    if TMA:
        return src.load([off_b, start, col]).reshape(ROWS, BLOCK_D)
    else:
        rows = start + tl.arange(0, ROWS)
        return load_tile(src + rows[:, None] * stride_n + offs_d[None, :], rows, offs_d, n_rows, CHECK_ROWS,
                         HEAD_DIM, BLOCK_D)


@triton.jit
def tile_ptrs(T, off_b, off_h, rows, offs_d, stride_b, stride_n, stride_h):
    """Pointers to `rows × offs_d` of head `off_h`, batch `off_b`, of a `(B, N, H, D)` tensor `T`
    (last dim contiguous)."""
    return T + off_b * stride_b + off_h * stride_h + rows[:, None] * stride_n + offs_d[None, :]


@triton.jit
def store_tile(ptrs, tile, rows, offs_d, n_rows, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    if HEAD_DIM == BLOCK_D:
        tl.store(ptrs, tile, mask=rows[:, None] < n_rows)
    else:
        tl.store(ptrs, tile, mask=(rows[:, None] < n_rows) & (offs_d[None, :] < HEAD_DIM))


@triton.jit
def block_bounds(lo, hi, valid, n, BLOCK: tl.constexpr):
    """Loop bounds of a block of rows whose visible intervals are [lo, hi) (other side's rows).

    Returns (start, u_lo, u_hi, end): every block of the other side in [start, end) holds a row
    some row here sees; blocks in [u_lo, u_hi) are seen whole by every row here (no mask needed),
    those in [start, u_lo) and [u_hi, end) need the mask. `start`, `u_lo`, `u_hi` lie on the
    BLOCK grid; `valid` excludes rows past the end, `n` is the other side's length.
    """
    lo = tl.maximum(lo, 0)
    hi = tl.minimum(hi, n)
    seen = valid & (lo < hi)
    start = tl.min(tl.where(seen, lo, n), 0)
    end = tl.max(tl.where(seen, hi, 0), 0)
    # Where every valid row sees something, what all of them see; an empty row empties it.
    all_lo = tl.max(tl.where(valid, tl.where(seen, lo, n), 0), 0)
    all_hi = tl.min(tl.where(valid, tl.where(seen, hi, 0), n), 0)
    start = start // BLOCK * BLOCK
    u_lo = (all_lo + BLOCK - 1) // BLOCK * BLOCK
    u_hi = all_hi // BLOCK * BLOCK
    has_full = u_hi > u_lo
    u_lo = tl.where(has_full, u_lo, start)
    u_hi = tl.where(has_full, u_hi, start)
    return start, u_lo, u_hi, end


@triton.jit
def visible_keys(rows, cols, kv_lo, kv_hi, Nk, CAUSAL: tl.constexpr, RANGES: tl.constexpr):
    """`(rows × cols)` mask of the keys each query row sees: its interval `[kv_lo, kv_hi)` (RANGES),
    else the keys that exist and, causal, are not after the row. (The forward and the dQ pass.)"""
    if RANGES:
        visible = (cols[None, :] >= kv_lo[:, None]) & (cols[None, :] < kv_hi[:, None])
    else:
        visible = cols[None, :] < Nk
        if CAUSAL:
            visible = visible & (rows[:, None] >= cols[None, :])
    return visible

