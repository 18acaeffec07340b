"""Exact merge of two partial attention results over disjoint key sets: `merge(o, lse, o_blk, lse_blk)`.

The math (logaddexp of the LSEs, sigmoid weights of their difference, safe at ±inf) lives with the
kernels as `kernels.ref_merge`, next to the Triton forward that fuses it (`attn_fwd(acc=...)`),
which is what the ring uses; this is its name in the ring's vocabulary, for merging results by hand
(e.g. partial attention from another source) and for the CPU tests.
"""

from ringflash.kernels import ref_merge as merge

__all__ = ["merge"]
