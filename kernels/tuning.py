"""Block shapes for the Triton kernels: a tuned table by default, autotuning on request.

Autotuning on every new shape costs seconds of compilation per candidate, on every fresh
process; training and the ring see a handful of shapes, over and over. So the launchers take
their tiles from `TUNED`, measured once per head dim with `launch/tune_kernels.py` on an H100
(docs/performance.md), and `RINGFLASH_AUTOTUNE=1` switches to `triton.autotune` over
`CANDIDATES` (cached per sequence length for the life of the process) for other devices.

A tile is `(outer, inner, num_warps, num_stages)`: for the forward and dQ kernels `outer` is the
query block and `inner` the key block; for dK/dV it is the other way round. `outer` is always a
multiple of `inner`, which the causal split into masked and unmasked stages relies on.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable

import triton

from ringflash.kernels.checks import interpreting

Tile = tuple[int, int, int, int]
KERNELS = ("fwd", "dkdv", "dq")

CANDIDATES: dict[str, list[Tile]] = {
    "fwd": [(128, 64, 8, 3), (128, 64, 4, 3), (128, 128, 8, 3), (128, 32, 4, 4), (64, 64, 4, 3),
            (64, 32, 4, 4), (128, 64, 8, 2), (128, 128, 8, 2), (128, 64, 8, 4)],
    "dkdv": [(128, 32, 8, 3), (128, 64, 8, 3), (64, 64, 4, 3), (64, 32, 4, 3), (128, 32, 4, 3),
             (128, 64, 8, 2), (64, 32, 4, 2), (128, 64, 8, 4), (128, 32, 8, 4), (128, 32, 4, 4)],
    "dq": [(128, 32, 8, 3), (128, 64, 8, 3), (64, 64, 4, 3), (64, 32, 4, 3), (128, 32, 4, 3),
           (128, 64, 8, 2), (64, 32, 4, 2), (128, 64, 8, 4), (128, 32, 8, 4), (64, 64, 4, 4)],
}

# (kernel, BLOCK_D) -> tile. Measured with launch/tune_kernels.py on an H100 (Triton 3.6), bf16,
# causal and not, B·N = 32k, H·D = 2048: D = 128 at N = 16k, D = 64 at N = 4k; re-swept with the
# tensor-descriptor loads, which free the registers a 128-key forward tile needs. Head dims 32 and 256 were not
# swept: 32 takes 64's tiles, 256 small ones that fit in shared memory.
TUNED: dict[tuple[str, int], Tile] = {
    ("fwd", 32): (128, 64, 8, 3), ("fwd", 64): (128, 64, 8, 3), ("fwd", 128): (128, 128, 8, 3),
    ("fwd", 256): (64, 64, 8, 2),
    ("dkdv", 32): (128, 32, 4, 3), ("dkdv", 64): (128, 32, 4, 3), ("dkdv", 128): (128, 64, 8, 3),
    ("dkdv", 256): (64, 32, 8, 2),
    ("dq", 32): (128, 64, 8, 4), ("dq", 64): (128, 64, 8, 4), ("dq", 128): (128, 64, 8, 3),
    ("dq", 256): (64, 32, 8, 2),
}

# Where the kernels load through pointers (before Hopper, float32 inputs, RINGFLASH_TMA=0) they
# keep the tiles of the sweep made with pointer loads wherever the descriptor sweep chose others:
# the 128×128 forward tile stages 224 KB of shared memory at 3 stages, more than an A100 has
# (164 KB), and it was the slower one with pointer loads on the H100.
POINTER_TUNED: dict[tuple[str, int], Tile] = {
    ("fwd", 32): (128, 64, 4, 3), ("fwd", 64): (128, 64, 4, 3), ("fwd", 128): (128, 64, 8, 3),
    ("dq", 32): (64, 64, 4, 3), ("dq", 64): (64, 64, 4, 3),
}

# dK/dV under GQA with descriptor loads: each program loops over the query heads sharing its K/V
# head, so the grid has GROUP times fewer, longer programs. From 8 query heads per K/V head (a 1B
# Llama's 32/4) causal programs are paired (kernels/triton_bwd.py) and, up to 8k queries, 64-key
# tiles double the programs again; at 16k the 128-key tile is faster paired, and at 32k the two
# tie: a group's Q and dO outgrow the 50 MB L2 there. Non-causal the 64-key tile gains 1.5-3% up to 8k too.
# D = 128 and groups of 4 keep TUNED.
GQA_TUNED: dict[tuple[str, int], Tile] = {("dkdv", 64): (64, 64, 4, 3)}
GQA_MIN_GROUP = 8
GQA_MAX_QUERIES = 8192


def pairs_dkdv(causal: bool, group: int, block_d: int) -> bool:
    """Whether causal dK/dV programs take two key blocks each (kernels/triton_bwd.py): where it
    was measured faster, D = 64 with 8+ query heads a K/V head. Without GQA it cost 1-3%, at
    D = 128 with 4 heads a K/V head 5-13%, with 8 (64/8, 32/4) 3-5% at 16k (+2% at 8k)."""
    return causal and group >= GQA_MIN_GROUP and block_d == 64

INTERPRETER_TILE: Tile = (64, 32, 4, 1)  # several key blocks per query block even on tiny shapes


def candidates(kernel: str, block_d: int) -> list[Tile]:
    """Tiles worth trying: at head dim 256 the large ones exhaust shared memory."""
    return [t for t in CANDIDATES[kernel] if block_d < 256 or t[0] * t[1] <= 64 * 64]


def autotuning() -> bool:
    """Whether `RINGFLASH_AUTOTUNE=1` asks for tiles by timing (never under the interpreter)."""
    return os.environ.get("RINGFLASH_AUTOTUNE", "0") == "1" and not interpreting()


def tile_for(kernel: str, block_d: int, descriptors: bool = False, group: int = 1, queries: int = 0) -> Tile:
    """The tuned tile for `kernel` at `block_d`, for descriptor (TMA) loads or pointer loads, with
    `group` query heads per K/V head and `queries` query rows."""
    if interpreting():
        return INTERPRETER_TILE
    key = (kernel, min(max(block_d, 32), 256))
    if descriptors and group >= GQA_MIN_GROUP and queries <= GQA_MAX_QUERIES and key in GQA_TUNED:
        return GQA_TUNED[key]
    return TUNED[key] if descriptors else POINTER_TUNED.get(key, TUNED[key])


@functools.cache  # one per (kernel, tile): building a Config on every launch costs the host
def tile_config(kernel: str, tile: Tile) -> triton.Config:
    outer, inner, warps, stages = tile
    names = ("BLOCK_N", "BLOCK_M") if kernel == "dkdv" else ("BLOCK_M", "BLOCK_N")
    return triton.Config({names[0]: outer, names[1]: inner}, num_warps=warps, num_stages=stages)


_autotuned: dict[tuple[str, int], Callable] = {}


def launch(kernel: str, jit_fn, grid: Callable[[dict], tuple], args: tuple, consts: dict,
           tile: Tile | None = None) -> None:
    """Launch `jit_fn` with the tile for `kernel` (or `tile`, as the tuning script does), chosen by
    the larger of its head dims' blocks (q·k's `BLOCK_D`, v's `BLOCK_DV`): both tiles' shared memory counts."""
    block_d = max(consts["BLOCK_D"], consts["BLOCK_DV"])
    if tile is None and autotuning():
        key = (kernel, block_d)
        if key not in _autotuned:
            configs = [tile_config(kernel, t) for t in candidates(kernel, block_d)]
            _autotuned[key] = triton.autotune(
                configs=configs, key=["Nq", "Nk", "CAUSAL", "RANGES", "GROUP", "HEAD_DIM", "HEAD_DIM_V"])(jit_fn)
        _autotuned[key][grid](*args, **consts)
        return
    config = tile_config(kernel, tile or tile_for(kernel, block_d))  # descriptor loads always pass theirs
    meta = {**consts, **config.kwargs}
    jit_fn[grid(meta)](*args, **meta, num_warps=config.num_warps, num_stages=config.num_stages)
