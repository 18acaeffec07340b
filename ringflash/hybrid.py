"""Head-parallel × ring attention (2D context parallelism): a DeepSpeed-Ulysses all-to-all
around the ring.

The context-parallel ranks form a grid of `u` head-parallel ranks × `r` ring ranks. With cp
index `c` (the rank in the whole context-parallel group), head rank `c % u` and ring rank
`c // u`: the head groups are runs of `u` consecutive ranks (inside a node, where the
all-to-all's traffic is cheapest) and the ring groups stride by `u` (`hybrid_groups`).

Who holds which tokens (the user's shard, `layout.shard(..., head_rank=, head_world=)`): the
global sequence is cut into `r` ring shards by the ring's layout (zigzag or contiguous), and
ring shard `i` into `u` equal consecutive pieces, of which head rank `j` holds piece `j`. So
rank (i, j) holds `N / (r·u)` tokens, all `H` heads.

Forward: one all-to-all over the head group turns "my piece, all heads" into "ring shard i's
tokens, heads [j·H/u, (j+1)·H/u)" (pieces concatenated in head-rank order give the ring shard
back, a valid ring-layout shard); the unchanged ring (`ring_flash_attn_func` over the ring
group) runs on it, so causal balance, documents, windows and skipped steps are the ring's; the
reverse all-to-all returns o (and lse) to "my piece, all heads". Backward: autograd runs the
mirror image, all-to-alls of the gradients around the ring's backward. Exact: nothing is
approximated, only moved.

GQA: head rank j needs the K/V heads of its query heads. If `u` divides `Hkv` each rank gets
`Hkv/u` whole K/V heads; if `Hkv` divides `u` (`Hkv < u`, MQA included), each K/V head is
repeated `u/Hkv` times before the all-to-all (one per rank, no more), and autograd sums the
copies' gradients back. Otherwise (Hkv = 6, u = 4) a rank's query heads would straddle K/V
heads: refused.

q, k and v travel in one all-to-all (heads concatenated per destination), o in one, lse in one.
Eager only: under torch.compile call the ring alone (u = 1).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from ringflash import agree
from ringflash.kernels.checks import check_qkv
from ringflash.transport import Transport, ring_comm
from ringflash.transport.groups import grid_of, group_timeout, register_grid

__all__ = ["grid_coords", "hybrid_attention", "hybrid_groups", "kv_heads_per_rank"]


def grid_coords(cp_rank: int, head_world: int) -> tuple[int, int]:
    """`(ring_rank, head_rank)` of context-parallel rank `cp_rank` in a grid with `head_world` head ranks."""
    return cp_rank // head_world, cp_rank % head_world


def hybrid_groups(
    head_world: int, group: dist.ProcessGroup | None = None
) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """`(ring_group, head_group)` of this rank for a grid of `head_world` head ranks over `group`'s
    ranks (None: the default group). Every rank of `group` must call it (it creates every group).

    Head groups: consecutive cp ranks `[i·u, (i+1)·u)`; ring groups: cp ranks `j, j+u, j+2u, …`.
    They wait as long as `group` does (its timeout), and are registered as parts of `group`, so
    that every call over them is checked across all of `group`'s ranks (ringflash/agree.py).
    """
    parent = group or dist.group.WORLD
    ranks = dist.get_process_group_ranks(parent)
    if not isinstance(head_world, int) or head_world < 1 or len(ranks) % head_world:
        raise ValueError(
            f"head_world must be a positive int dividing the group's {len(ranks)} ranks, got {head_world!r}"
        )
    u, me, timeout = head_world, dist.get_rank(), group_timeout(parent)
    mine: dict[str, dist.ProcessGroup] = {}
    for i in range(len(ranks) // u):  # every rank creates every group, in the same order
        g = dist.new_group(ranks[i * u : (i + 1) * u], timeout=timeout)
        if me in ranks[i * u : (i + 1) * u]:
            mine["head"] = g
    for j in range(u):
        g = dist.new_group(ranks[j::u], timeout=timeout)
        if me in ranks[j::u]:
            mine["ring"] = g
    register_grid(parent, mine["ring"], mine["head"])
    return mine["ring"], mine["head"]


def kv_heads_per_rank(heads: int, kv_heads: int, head_world: int) -> int:
    """K/V heads each head rank holds after the all-to-all (replicating only if Hkv < u).

    Raises ValueError naming the argument when the heads do not split over `head_world` ranks.
    """
    u = head_world
    if heads % u:
        raise ValueError(
            f"q.shape[2] (H = {heads} heads) must be divisible by the head-parallel degree u = {u} "
            "(head_group's size): each head rank takes H/u query heads"
        )
    if kv_heads % u == 0:
        return kv_heads // u
    if u % kv_heads == 0:
        return 1  # each K/V head repeated u/Hkv times: one copy per head rank that needs it
    raise ValueError(
        f"k.shape[2] (Hkv = {kv_heads} K/V heads) and the head-parallel degree u = {u} (head_group's size): "
        f"one must divide the other, so that each head rank's {heads // u} query heads share whole K/V heads"
    )


# ---- the all-to-alls ---------------------------------------------------------------------------


def _seq_to_heads(comm: Transport, xs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each `(B, n, u·h_i, D_i)` ("my tokens, all heads") to `(B, u·n, h_i, D_i)` ("the ring shard's
    tokens, my heads"), every tensor in one all-to-all (same dtype; head dims may differ: v's)."""
    u = comm.world
    B, n = xs[0].shape[:2]
    hs, ds = [x.shape[2] // u for x in xs], [x.shape[3] for x in xs]
    widths = [h * d for h, d in zip(hs, ds)]
    # (u, B, n, Σh·D): chunk j holds heads [j·h_i, (j+1)·h_i) of every x, for head rank j.
    send = torch.cat([x.reshape(B, n, u, w) for x, w in zip(xs, widths)], 3).permute(2, 0, 1, 3).contiguous()
    recv = torch.empty_like(send)
    comm.all_to_all(send, recv).wait()
    # recv chunk j: head rank j's tokens (piece j of the ring shard), my heads.
    out = recv.permute(1, 0, 2, 3).split(widths, 3)
    return [t.reshape(B, u * n, h, d) for t, h, d in zip(out, hs, ds)]


def _heads_to_seq(comm: Transport, xs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Inverse of `_seq_to_heads`: each `(B, u·n, h_i, D_i)` back to `(B, n, u·h_i, D_i)`."""
    u = comm.world
    B, un = xs[0].shape[:2]
    n, hs, ds = un // u, [x.shape[2] for x in xs], [x.shape[3] for x in xs]
    widths = [h * d for h, d in zip(hs, ds)]
    send = torch.cat([x.reshape(B, u, n, w) for x, w in zip(xs, widths)], 3).transpose(0, 1).contiguous()
    recv = torch.empty_like(send)
    comm.all_to_all(send, recv).wait()
    out = recv.permute(1, 2, 0, 3).split(widths, 3)  # (B, n, u, h_i·D_i): chunk j = heads of rank j
    return [t.reshape(B, n, u * h, d) for t, h, d in zip(out, hs, ds)]


def _lse_to_seq(comm: Transport, lse: torch.Tensor) -> torch.Tensor:
    """lse `(B, h, u·n)` of the ring shard, my heads, to `(B, u·h, n)`: my tokens, all heads."""
    u = comm.world
    B, h, un = lse.shape
    send = lse.reshape(B, h, u, un // u).permute(2, 0, 1, 3).contiguous()
    recv = torch.empty_like(send)
    comm.all_to_all(send, recv).wait()
    return recv.transpose(0, 1).reshape(B, u * h, un // u)


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, comm, *xs):
        ctx.comm = comm
        return tuple(_seq_to_heads(comm, list(xs)))

    @staticmethod
    def backward(ctx, *grads):
        return None, *_heads_to_seq(ctx.comm, [g.contiguous() for g in grads])


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, comm, *xs):
        ctx.comm = comm
        return tuple(_heads_to_seq(comm, list(xs)))

    @staticmethod
    def backward(ctx, *grads):
        return None, *_seq_to_heads(ctx.comm, [g.contiguous() for g in grads])


# ---- checks ------------------------------------------------------------------------------------


def _check_comms(head: Transport, ring: Transport | None) -> list[Transport]:
    """Where the grid's agreement check gathers: the grid the head group was registered in
    (`hybrid_groups`), else the head group then the ring group (together they reach every rank
    of a grid, but a rank that does not make the hybrid call leaves the other stage waiting).
    `ring` is None when this rank's `group` is unusable: it still joins what the others join."""
    grid = grid_of(head.group)
    if grid is not None and (ring is None or grid_of(ring.group) is grid):
        return [ring_comm(grid, "nccl")]
    return [head, *([ring] if ring is not None else [])]


def _check_local(q, k, v, head_group, group, u: int) -> int:
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a torch.distributed.ProcessGroup, got {type(group).__name__}")
    if group is None:
        raise ValueError(
            "group: with head_group= give the ring group explicitly (a group of one rank when r = 1); "
            "ringflash.hybrid_groups(u) builds both"
        )
    both = set(dist.get_process_group_ranks(head_group)) & set(dist.get_process_group_ranks(group))
    if both != {dist.get_rank()}:
        raise ValueError(
            f"head_group and group must meet only in this rank (a grid), but share global ranks {sorted(both)}"
        )
    check_qkv(q, k, v)  # here, before the all-to-all: a rank refusing later would strand its head group
    if k.shape[1] != q.shape[1]:
        raise ValueError(f"k.shape[1] (local seqlen) must equal q.shape[1] = {q.shape[1]}, got {k.shape[1]}")
    return kv_heads_per_rank(q.shape[2], k.shape[2], u)


# ---- the layer ---------------------------------------------------------------------------------


def hybrid_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    ring: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
    head_group: dist.ProcessGroup,
    group: dist.ProcessGroup | None,
    causal: bool,
    layout: str,
    check_ranks: bool = True,
    settings: Callable[[], dict] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Head-parallel × ring attention (module docstring); differentiable in q, k, v.

    q `(B, n, H, D)`, k `(B, n, Hkv, D)`, v `(B, n, Hkv, Dv)`: this rank's piece (`shard(..., head_rank=,
    head_world=)`). `ring(q, k, v) -> (o, lse)`: the ring over `group` on `(B, u·n, H/u, D)`
    blocks (the public API's, with every setting bound). `settings() -> dict`: the ring's other
    settings as `agree.row` takes them (softmax_scale, window, mask_key, transport),
    raising TypeError/ValueError on bad ones. Returns o `(B, n, H, Dv)` in q's dtype and lse
    `(B, H, n)` float32, natural log (not differentiable).

    Before the first all-to-all every rank of the grid agrees on all of it (`agree.check`):
    a rank that refused there would strand its head group in the all-to-all.
    """
    head = ring_comm(head_group, "nccl")  # the group's own all_to_all, whatever moves the ring's blocks
    u, ring_c = head.world, None
    error, fields = None, {}
    try:
        ring_c = ring_comm(group, "nccl") if group is not None else None
        hk = _check_local(q, k, v, head_group, group, u)
        fields = settings() if settings is not None else {}
    except (TypeError, ValueError) as e:
        error = e
    if check_ranks:
        comms = _check_comms(head, ring_c)
        r = ring_c.world if ring_c is not None else -1
        mine = agree.row(error is None, "hybrid attention", r, u, q=q, k=k, v=v, causal=causal, layout=layout, **fields)
        try:
            agree.check(comms, mine)
        except ValueError as e:
            error = error or e
    if error is not None:
        raise error
    if hk * u > k.shape[2]:  # Hkv < u: one copy of each K/V head per head rank that needs it
        k, v = (t.repeat_interleave(hk * u // t.shape[2], dim=2) for t in (k, v))
    qh, kh, vh = _SeqToHeads.apply(head, q, k, v)
    o, lse = ring(qh, kh, vh)
    (o,) = _HeadsToSeq.apply(head, o)
    return o, _lse_to_seq(head, lse.detach())
