"""ringflash: exact ring attention over torch.distributed on top of FlashAttention-2 kernels.

    from ringflash import ring_flash_attn_func, shard, global_positions
    q_local = shard(q, dim=1, rank=rank, world=world)          # (B, N/W, H, D), zigzag layout
    o_local = ring_flash_attn_func(q_local, k_local, v_local, causal=True)

`ring_flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes,
deterministic, return_attn_probs, group, *, layout, ...)`: flash_attn's positional order.
ring-flash-attention's functions, same names and arguments: `ringflash.ring_flash_attn`.

All-gather context parallelism (ringflash/allgather.py): `scheme="allgather"`, with
`gather_mask(doc_ids, ...)` for documents. Layouts: zigzag, contiguous, stripe (token t on rank t mod W).

Packed documents and sliding windows: `mask = ring_mask(doc_ids, group=g, window=w, device=...)`
once per batch (doc_ids global, unsharded), then `ring_flash_attn_func(..., mask=mask)`.

Modules: `layout` (sharding and per-step schedule), `masks` (document/window masks per ring
step), `merge` (float32 (o, lse) merge), `transport` (how blocks travel: NCCL or gloo, copy
engines, or not at all), `ring` (the forward/backward loops, no autograd), `ops` (the ring
as the custom op `torch.ops.ringflash.ring_attn` with its autograd formula, which `api` calls and
torch.compile traces as one node), `api`, `ring_flash_attn` (the drop-in for ring-flash-attention).
LSE convention everywhere: float32, natural log, shape `(B, H, N)`.
"""

from ringflash import layout, ops
from ringflash.allgather import GatherMask, gather_mask
from ringflash.api import (
    RingFlashAttention,
    ring_flash_attn_func,
    ring_flash_attn_kvpacked_func,
    ring_flash_attn_qkvpacked_func,
)
from ringflash.hybrid import grid_coords, hybrid_groups
from ringflash.layout import LAYOUTS, SCHEMES, check_splittable, global_positions, shard, unshard
from ringflash.masks import RingMask, ring_mask
from ringflash.merge import merge
from ringflash.transport import NullComm, RingComm, nccl_options

__all__ = [
    "LAYOUTS",
    "SCHEMES",
    "GatherMask",
    "NullComm",
    "RingComm",
    "RingFlashAttention",
    "RingMask",
    "check_splittable",
    "gather_mask",
    "global_positions",
    "grid_coords",
    "hybrid_groups",
    "layout",
    "merge",
    "nccl_options",
    "ops",
    "ring_flash_attn_func",
    "ring_flash_attn_kvpacked_func",
    "ring_flash_attn_qkvpacked_func",
    "ring_mask",
    "shard",
    "unshard",
]
