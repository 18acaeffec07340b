"""All-gather context parallelism (Llama 3's): every rank gathers all K/V, attends its own queries.

    o = ring_flash_attn_func(q, k, v, causal=True, group=cp_group, scheme="allgather")
    mask = gather_mask(doc_ids, group=cp_group, window=w, device=q.device)  # packed documents, once per batch
    o = ring_flash_attn_func(q, k, v, causal=True, group=cp_group, scheme="allgather", mask=mask)

q, k, v are this rank's shard in any layout (ringflash/layout.py). Forward, per chunk of
`heads_k_stride` K/V heads: all-gather this chunk of K and V (packed, one collective), put the
gathered keys back into global order (`unshard`), and run one kernel call of this rank's queries
(their query heads of the chunk) against all N_global keys, with the exact per-row key intervals
of their global positions (`kernels.visibility`: causal, window, documents). The next chunk's
gather is posted before this chunk computes, so it travels meanwhile; the gathered K/V of at most
two chunks (and the global-order copy of one) are alive at a time, which bounds memory by
`heads_k_stride`, not by the number of heads.
Backward, per chunk: gather K/V again (nothing the size of the global K/V is saved), compute dQ
and the global dK/dV of the chunk in float32, cut them back into each rank's shard and
reduce-scatter them (summed in float32, then rounded once), overlapped with the next chunk.

Against the ring: the same FLOPs, no merge, one kernel call per chunk whatever the mask (any
document mask is balanced exactly as the layout balances tokens), communication of all K/V
(cheap under GQA, where K/V are a fraction of Q) as two collectives instead of W − 1 hops.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ringflash.kernels import FULL, AttnSpec, Backend, Visibility, visibility
from ringflash.layout import check_layout, check_splittable, global_positions, shard, unshard
from ringflash.ring import kv_views, pack_kv
from ringflash.transport.p2p import _Transfer

__all__ = ["GatherMask", "allgather_backward", "allgather_forward", "gather_mask", "gather_spec"]

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass(frozen=True, eq=False)
class GatherMask:
    """This rank's queries against the whole sequence under documents/window (`gather_mask`).

    `spec`: the kernels' `AttnSpec` of local rows `(n_local,)` over N_global keys in global order;
    `call`: the `AttnSpec` of the whole sequence before documents (causal and window; read as
    `causal`, `window`); `layout`, `rank`, `world`, `n_local`; `fingerprint`: an int64 hash of
    the mask's global definition, compared across ranks by the agreement check.
    """

    spec: AttnSpec
    call: AttnSpec
    layout: str
    rank: int
    world: int
    n_local: int
    fingerprint: int

    @property
    def causal(self) -> bool:
        return self.call.causal

    @property
    def window(self) -> int | tuple[int, int] | None:
        return self.call.window


def gather_spec(n_local: int, rank: int, world: int, layout: str, causal: bool, window: int | None, device,
                doc: torch.Tensor | None = None) -> AttnSpec:  # fmt: skip
    """The `AttnSpec` of rank `rank`'s `n_local` query rows over all `n_local · world` keys in
    global order: FULL without causality, documents or window, else per-row key intervals.
    `doc`: global document ids `(B, N_global)` int64 on the host, or None."""
    if not causal and window is None and doc is None:
        return FULL
    if doc is None:
        return _cached_spec(n_local, rank, world, layout, causal, window, torch.device(device))
    q_pos = global_positions(n_local, rank, world, layout)
    vis = visibility(q_pos, torch.arange(n_local * world), causal=causal, window=window,
                     q_doc=shard(doc, 1, rank, world, layout), k_doc=doc)  # fmt: skip
    return AttnSpec(intervals=Visibility(*(t.to(device) for t in vis)))


@functools.lru_cache(maxsize=64)
def _cached_spec(n_local, rank, world, layout, causal, window, device) -> AttnSpec:
    q_pos = global_positions(n_local, rank, world, layout)
    vis = visibility(q_pos, torch.arange(n_local * world), causal=causal, window=window)
    return AttnSpec(intervals=Visibility(*(t.to(device) for t in vis)))


def gather_mask(
    doc_ids: torch.Tensor | None,
    *,
    seqlen: int | None = None,
    group: dist.ProcessGroup | None = None,
    layout: str = "zigzag",
    causal: bool = True,
    window: int | None = None,
    device: torch.device | str | None = None,
) -> GatherMask:
    """`ring_mask`'s arguments and checks (ringflash/masks.py), for `scheme="allgather"`.

    doc_ids: global `(B, N_global)` or `(N_global,)` document ids, non-decreasing along each row
    (None: one document of `seqlen` tokens); window: causal sliding window of w keys counting
    the diagonal; device: where the intervals live (q's device; default doc_ids').
    """
    from ringflash import masks  # its checks and fingerprint; masks imports nothing of ours

    check_layout(layout)
    call = AttnSpec(causal=causal, window=window)
    rank, world = masks._group_rank_world(group)
    doc = None if doc_ids is None else masks._check_doc_ids(doc_ids)
    if doc is None and seqlen is None:
        raise ValueError("seqlen: give N_global when doc_ids is None (one document)")
    n_global = seqlen if doc is None else doc.shape[1]
    if doc is not None and seqlen is not None and seqlen != n_global:
        raise ValueError(f"seqlen={seqlen} disagrees with doc_ids.shape[-1] = {n_global}")
    check_splittable(n_global, world, layout)
    device = masks._device(device if device is not None or doc_ids is None else doc_ids.device)
    _, fp = masks._fingerprint(causal, window, layout, world, n_global, doc)
    spec = gather_spec(n_global // world, rank, world, layout, causal, window, device, doc)
    return GatherMask(spec, call, layout, rank, world, n_global // world, fp)


def varlen_spec(cu_q: list[int], cu_k: list[int], k_slice: slice, n_global: int, causal: bool, window: int | None,
                device) -> AttnSpec:  # fmt: skip
    """Documents in flash_attn's varlen convention over all-gathered keys (ring-flash-attention's
    llama3 functions): query document d (local rows `cu_q[d]:cu_q[d+1]`) sees key document d
    (global keys `k_slice.start + cu_k[d]` to `k_slice.start + cu_k[d+1]`), causal aligned at the
    documents' ends (a query document's last row sees its key document's last key). Host ints in;
    raises ValueError naming cu_seqlens_q / cu_seqlens_k / local_k_slice."""
    lq = [b - a for a, b in itertools.pairwise(cu_q)]
    lk = [b - a for a, b in itertools.pairwise(cu_k)]
    if len(lq) != len(lk):
        raise ValueError(f"cu_seqlens_k must hold as many documents as cu_seqlens_q ({len(lq)}), got {len(lk)}")
    if min(lk, default=0) < 0 or cu_k[0] != 0:
        raise ValueError(f"cu_seqlens_k must rise from 0, got {cu_k}")
    if cu_k[-1] != k_slice.stop - k_slice.start:
        raise ValueError(f"cu_seqlens_k must end at the length of local_k_slice ({k_slice}), got {cu_k[-1]}")
    if causal and any(q > k for q, k in zip(lq, lk)):
        raise ValueError(f"cu_seqlens_k: with causal=True each key document must be at least as long as its query "
                         f"document, got query lengths {lq} and key lengths {lk}")  # fmt: skip
    d_q = torch.repeat_interleave(torch.arange(len(lq)), torch.tensor(lq))
    k_doc = torch.full((n_global,), len(lk))  # after the slice: no document of ours (ids stay non-decreasing)
    k_doc[: k_slice.start] = -1
    k_doc[k_slice] = torch.repeat_interleave(torch.arange(len(lk)), torch.tensor(lk))
    if causal:  # each query's position is its key document's end minus its distance from its own end
        ends = torch.tensor(cu_k[1:]) + k_slice.start
        q_pos = ends[d_q] - (torch.tensor(cu_q[1:])[d_q] - torch.arange(cu_q[-1]))
    else:
        q_pos = torch.arange(cu_q[-1])
    vis = visibility(q_pos, torch.arange(n_global), causal=causal, window=window, q_doc=d_q, k_doc=k_doc)
    return AttnSpec(intervals=Visibility(*(t.to(device) for t in vis)))


def prepare_cu_seqlens(cu: list[int], causal: bool, rank: int, world: int):
    """ring-flash-attention's `llama3_flash_attn_prepare_cu_seqlens` on host ints (its docstring)."""
    total = cu[-1]
    if len(cu) < 2 or cu[0] != 0 or any(b < a for a, b in itertools.pairwise(cu)) or total % world:
        raise ValueError(f"cu_seqlens must rise from 0 to a total divisible by world_size={world}, got {cu}")
    n = total // world
    lo, hi = rank * n, (rank + 1) * n
    first = max(i for i, c in enumerate(cu) if c <= lo)  # the document holding token lo starts at cu[first]
    last = min(i for i, c in enumerate(cu) if c >= hi)  # and the one holding token hi - 1 ends at cu[last]
    bounds = cu[first : last + 1]
    cu_q = [0] + [c - lo for c in bounds[1:-1]] + [n]
    k_stop = hi if causal else cu[last]
    cu_k = [c - bounds[0] for c in bounds[:-1]] + [k_stop - bounds[0]]
    widths = lambda c: max(b - a for a, b in itertools.pairwise(c))
    return cu_q, cu_k, widths(cu_q), widths(cu_k), slice(bounds[0], k_stop)


# ---- the loops (no autograd) --------------------------------------------------------------------


def _chunks(hkv: int, stride: int) -> list[slice]:
    return [slice(h, min(h + stride, hkv)) for h in range(0, hkv, stride)]


def _post(comm, collective, out: torch.Tensor, inp: torch.Tensor) -> _Transfer:
    """Post `collective(out, inp)` over comm's group; CUDA tensors on a gloo group go through pinned
    host memory, as the ring's transfers do (transport/p2p.py). `wait()` lands the result in out."""
    src, dst, host_out = comm._stage(inp, out)
    return _Transfer([collective(dst, src, group=comm.group, async_op=True)], out, src, host_out)


def _gather(k, v, heads: slice, comm):
    """Post the all-gather of K/V heads `heads`: returns `(buffer (W, B, n, s, D + Dv), transfer)`,
    each rank's K and V packed (`ring.pack_kv`): one collective for both."""
    kv = pack_kv(k[:, :, heads], v[:, :, heads])
    if comm.world == 1:
        return kv[None], None
    buf = kv.new_empty((comm.world, *kv.shape))
    return buf, _post(comm, _all_gather, buf.view(-1, *kv.shape[1:]), kv)


def _global(buf, d: int, layout) -> tuple[torch.Tensor, torch.Tensor]:
    """The gathered shards as global-order K `(B, N_global, s, d)`, V `(B, N_global, s, Dv)`."""
    parts = [kv_views(b, d) for b in buf.unbind(0)]
    if len(parts) == 1:
        return parts[0]
    return tuple(unshard([p[i] for p in parts], 1, layout) for i in range(2))


def _pipeline(k, v, stride, comm):
    """Yield `(heads, gathered buffer)` per chunk, the next chunk's gather already posted."""
    chunks = _chunks(k.shape[2], stride)
    pending = _gather(k, v, chunks[0], comm)
    for i, heads in enumerate(chunks):
        buf, work = pending
        if work is not None:
            work.wait()
        if i + 1 < len(chunks):
            pending = _gather(k, v, chunks[i + 1], comm)
        yield heads, buf


def allgather_forward(q, k, v, spec: AttnSpec, *, scale: float, kernels: Backend, comm, layout: str,
                      heads_k_stride: int, out_dtype=None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """q `(B, n, H, D)`, k `(B, n, Hkv, D)`, v `(B, n, Hkv, Dv)`: this rank's shard. Returns
    `o (B, n, H, Dv)` in `out_dtype` (default q's; float32 for a caller that rescales it, a sink)
    and `lse (B, H, n)` float32, natural log, over the whole sequence. `spec`: `gather_spec`
    (with the call's softcap); `comm`: the group's `RingComm` (ringflash.transport.ring_comm)."""
    g = q.shape[2] // k.shape[2]
    o = torch.empty((*q.shape[:3], v.shape[3]), dtype=out_dtype or q.dtype, device=q.device)
    lse = torch.empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32, device=q.device)
    for heads, buf in _pipeline(k, v, heads_k_stride, comm):
        qh = slice(heads.start * g, heads.stop * g)  # query head h uses K/V head h // g
        kg, vg = _global(buf, k.shape[3], layout)
        o_c, lse_c = kernels.fwd_step(q[:, :, qh], kg, vg, spec, scale, out_dtype=out_dtype)
        o[:, :, qh] = o_c
        lse[:, qh] = lse_c
    return o, lse


def allgather_backward(do, q, k, v, o, lse, spec: AttnSpec, *, scale: float, kernels: Backend, comm, layout: str,
                       heads_k_stride: int) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """Gradients `(dq, dk, dv)` like q, k, v, for the global `o`, `lse` of `allgather_forward`."""
    g = q.shape[2] // k.shape[2]
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk, dv = (
        torch.empty_like(k, memory_format=torch.contiguous_format),
        torch.empty_like(v, memory_format=torch.contiguous_format),
    )
    scattered = None  # (heads, float32 sums, work): the previous chunk's reduce-scatter in flight

    def land(item):
        heads, sums, work = item
        if work is not None:
            work.wait()
        dk[:, :, heads], dv[:, :, heads] = sums  # rounded once, after the float32 sum over ranks

    d = k.shape[3]

    world = comm.world
    for heads, buf in _pipeline(k, v, heads_k_stride, comm):
        qh = slice(heads.start * g, heads.stop * g)
        kg, vg = _global(buf, d, layout)
        dq_c, dk_g, dv_g = kernels.bwd_step(do[:, :, qh], q[:, :, qh], kg, vg, o[:, :, qh], lse[:, qh], spec, scale,
                                            grad_dtype=torch.float32)  # fmt: skip
        dq[:, :, qh] = dq_c
        if world == 1:
            item = (heads, (dk_g, dv_g), None)
        else:  # each rank's rows, rank-major, as reduce_scatter hands out, dK and dV packed as K and V
            B, N, s, _ = dk_g.shape
            parts = dk_g.new_empty((world, B, N // world, s, d + dv_g.shape[3]))
            for j in range(world):
                for dst, grad in zip(kv_views(parts[j], d), (dk_g, dv_g)):
                    dst.copy_(shard(grad, 1, j, world, layout))
            sums = parts.new_empty(parts.shape[1:])
            work = _post(comm, _reduce_scatter, sums, parts.view(-1, *parts.shape[2:]))
            item = (heads, kv_views(sums, d), work)
        if scattered is not None:
            land(scattered)
        scattered = item
    land(scattered)
    return dq, dk, dv  # apart, not views of one block: a custom op's outputs may not alias
