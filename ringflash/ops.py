"""Ring attention as a PyTorch custom op, so that `torch.compile` traces it as one node.

    o, lse, _ = torch.ops.ringflash.ring_attn(q, k, v, [], causal=True, softmax_scale=0.125,
                                              layout="zigzag", group_name="", backend=None,
                                              check_ranks=False)

`ringflash::ring_attn` runs `ring.ring_forward` and `ringflash::ring_attn_bwd` runs
`ring.ring_backward`; the first is differentiable in q, k, v through the second (registered with
`register_autograd`), and both have fake implementations (shapes and dtypes only), so Dynamo and
AOTAutograd never look inside the ring loop, its communication or its kernels. Public callers use
`ringflash.ring_flash_attn_func`, which validates the inputs and calls the op under
torch.compile; in eager it calls the same functions through `ring_attn_eager`, a plain
autograd.Function that skips torch.library's dispatch (host time the GPU waits for at small
blocks).

The process group cannot be an op argument (op schemas take tensors, scalars and strings), so it
travels by name: `group.group_name`, the key under which torch.distributed registers every group,
turned back into the group at run time by `_resolve_process_group` (what torch's own functional
collectives do). `""` stands for `group=None`: the default group, or this process alone when
torch.distributed is not initialised.

The cross-rank check (ringflash/agree.py) runs inside the op when `check_ranks=True`, at run
time, so it costs the same compiled or not and needs no graph break: each rank all-gathers its
row over the whole context-parallel group and raises if any differs. A rank whose own inputs
fail validation never reaches the op; `announce_rejection` sends its "rejected" row into the
same all_gather instead.

A document/window mask (`ringflash.RingMask`, ringflash/masks.py) travels as op arguments:
its `Visibility` tensors as the flat input list `mask_vis` (4 per masked step; `[]` without a
mask), its host metadata (rows and kind of each step, skipped steps) as the ints `mask_plan`
(5 per step; empty without a mask), and, for the cross-rank check, `window` and the mask's
`mask_key` (a hash of its global definition: documents' boundaries, window, layout, world).
Under torch.compile the ints are constants of the graph: a batch whose plan differs (other
skipped steps or rows) recompiles; the tensors are inputs and change freely.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from ringflash import agree
from ringflash.kernels import device_guard, get_backend
from ringflash.layout import ring_schedule
from ringflash.masks import decode
from ringflash.ring import ring_backward, ring_forward
from ringflash.transport import Transport, ring_comm

__all__ = ["announce_rejection", "group_name", "ring_attn", "ring_attn_bwd", "ring_attn_eager"]


def group_name(group: dist.ProcessGroup | None) -> str:
    """The op's name for `group`: its registered name, or `""` for None (default group / no group)."""
    return "" if group is None else group.group_name


def _comm(name: str, transport: str = "nccl") -> Transport:
    if not name:
        return ring_comm(None, transport)
    # Private in torch (2.4 to 2.13 at least) but the supported way to go from name to group: the
    # functional collectives and DTensor rely on it.
    from torch.distributed.distributed_c10d import _resolve_process_group

    return ring_comm(_resolve_process_group(name), transport)


# ---- cross-rank check (ringflash/agree.py) ------------------------------------------------------


def announce_rejection(comm: Transport, q, k, causal, layout) -> None:
    """This rank rejected its inputs: tell the others, who wait in the op's agreement check."""
    agree.announce(agree.check_comm(comm.group), "ring attention", comm.world, q=q, k=k, causal=causal, layout=layout)


def _plan(comm: Transport, q: Tensor, causal: bool, layout: str, mask_plan, mask_vis) -> list:
    """The ring's steps: a mask's (decoded from the op's arguments), or the layout's schedule."""
    if mask_plan:
        return decode(list(mask_plan), list(mask_vis))
    return ring_schedule(comm.rank, comm.world, q.shape[1], causal, layout)


# ---- the ops ----------------------------------------------------------------------------------


def _ring_attn(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask_vis: list[Tensor],
    *,
    causal: bool,
    softmax_scale: float,
    layout: str,
    group_name: str,
    backend: str | None,
    check_ranks: bool,
    window: int | None = None,
    mask_plan: list[int] | None = None,
    mask_key: int = 0,
    transport: str = "nccl",
) -> tuple[Tensor, Tensor, Tensor]:
    """`ring.ring_forward` over the group named `group_name`.

    Returns `o` like q, `lse (B, H, N)` float32, and what the backward needs of k and v: the
    packed `(2, B, N, Hkv, D)` buffer the ring started from (saved so that the backward's ring
    need not pack again), or an empty tensor on one rank (the backward then takes k and v).
    `mask_vis`, `mask_plan`, `window`, `mask_key`: a `RingMask` (module docstring). `transport`:
    how the blocks travel (`ringflash.transport.TRANSPORTS`).
    """
    with device_guard(q):  # the transport's streams and buffers and every launch on q's GPU
        comm = _comm(group_name, transport)
        checker = agree.check_comm(comm.group) if check_ranks else None
        if checker is not None and checker.world > 1:  # the whole grid when the group is part of one: a ring of one too
            mine = agree.row(True, "ring attention", comm.world, q=q, k=k, causal=causal, softmax_scale=softmax_scale,
                             layout=layout, window=window, mask_key=mask_key, transport=comm.name)  # fmt: skip
            agree.check(checker, mine)
        plan = _plan(comm, q, causal, layout, mask_plan, mask_vis)
        # Autocast off: the merge and accumulators are float32 by design, and the reference kernel's
        # float32 einsums must not be recast to half precision.
        with torch.autocast(q.device.type, enabled=False):
            kern = get_backend(backend, q.device)
            o, lse, kv = ring_forward(q, k, v, plan, scale=softmax_scale, kernels=kern, comm=comm)
    return o.contiguous(), lse.contiguous(), kv if comm.world > 1 else q.new_empty(0)


ring_attn = torch.library.custom_op("ringflash::ring_attn", _ring_attn, mutates_args=())


@ring_attn.register_fake
def _(q, k, v, mask_vis, *, causal, softmax_scale, layout, group_name, backend, check_ranks, window=None,
      mask_plan=None, mask_key=0, transport="nccl"):  # fmt: skip
    B, N, H, _ = q.shape
    world = _comm(group_name).world  # a trace-time constant, like every shape here
    return (
        torch.empty_like(q, memory_format=torch.contiguous_format),
        q.new_empty((B, H, N), dtype=torch.float32),
        k.new_empty((2, *k.shape)) if world > 1 else q.new_empty(0),
    )


def _ring_attn_bwd(
    do: Tensor,
    q: Tensor,
    kv: list[Tensor],
    o: Tensor,
    lse: Tensor,
    mask_vis: list[Tensor],
    *,
    causal: bool,
    softmax_scale: float,
    layout: str,
    group_name: str,
    backend: str | None,
    mask_plan: list[int] | None = None,
    transport: str = "nccl",
) -> tuple[Tensor, Tensor]:
    """`ring.ring_backward`: `dq` like q and `dkv (2, B, N, Hkv, D)` (dK, dV packed, as they come
    home in one message; the autograd formula splits them, outside the op, without a copy).

    `kv` is `[packed]` as `ring_attn` returned it, or `[k, v]` on one rank.
    """
    with torch.autocast(q.device.type, enabled=False), device_guard(q):
        comm = _comm(group_name, transport)
        return ring_backward(
            do.contiguous(), q, kv[0] if len(kv) == 1 else tuple(kv), o, lse,
            _plan(comm, q, causal, layout, mask_plan, mask_vis),
            scale=softmax_scale, kernels=get_backend(backend, q.device), comm=comm,
        )  # fmt: skip


ring_attn_bwd = torch.library.custom_op("ringflash::ring_attn_bwd", _ring_attn_bwd, mutates_args=())


@ring_attn_bwd.register_fake
def _(do, q, kv, o, lse, mask_vis, *, causal, softmax_scale, layout, group_name, backend, mask_plan=None,
      transport="nccl"):  # fmt: skip
    kshape = kv[0].shape[1:] if len(kv) == 1 else kv[0].shape
    return q.new_empty(q.shape), q.new_empty((2, *kshape))


def _setup_context(ctx, inputs, keyword_only_inputs, output):
    q, k, v, mask_vis = inputs
    o, lse, kv = output
    # The packed buffer, or k and v themselves on one rank (kv is then empty); then the mask's
    # Visibility tensors.
    kvs = [kv] if kv.numel() else [k, v]
    ctx.n_kv = len(kvs)
    ctx.save_for_backward(q, o, lse, *kvs, *mask_vis)
    drop = ("check_ranks", "window", "mask_key")  # the cross-rank check ran in the forward
    ctx.kwargs = {key: val for key, val in keyword_only_inputs.items() if key not in drop}
    ctx.mark_non_differentiable(lse, kv)
    # lse and kv never get a gradient: without this autograd would hand the backward zeros the
    # size of kv, a memset as large as K and V per call. o's gradient may then be None too
    # (`_grads`).
    ctx.set_materialize_grads(False)


def _grads(ctx, do, backward) -> tuple:
    """dq, dk, dv and the mask's (None) from `backward`: the backward op, or its function in eager."""
    q, o, lse, *rest = ctx.saved_tensors
    kv, mask_vis = rest[: ctx.n_kv], rest[ctx.n_kv :]
    if do is None:  # o's gradient is undefined (grads are not materialised): so are q's, k's, v's
        return None, None, None, [None] * len(mask_vis)
    dq, dkv = backward(do, q, kv, o, lse, mask_vis, **ctx.kwargs)
    return dq, dkv[0], dkv[1], [None] * len(mask_vis)


ring_attn.register_autograd(lambda ctx, do, _dlse, _dkv: _grads(ctx, do, ring_attn_bwd), setup_context=_setup_context)


class _EagerRingAttn(torch.autograd.Function):
    """The ops' functions under a plain autograd.Function: what eager calls run.

    Same forward, backward and saved tensors as `ring_attn`, without torch.library's dispatch
    (argument defaults, pytrees, the Dynamo guard around the implementation): host time that small
    blocks make the GPU wait for, since at 8k a call's host time is close to its GPU time.
    Under torch.compile `ring_flash_attn_func` calls the op, which Dynamo sees as one node.
    """

    @staticmethod
    def forward(ctx, q, k, v, kwargs, *mask_vis):
        mask_vis = list(mask_vis)
        out = _ring_attn(q, k, v, mask_vis, **kwargs)
        _setup_context(ctx, (q, k, v, mask_vis), kwargs, out)
        return out

    @staticmethod
    def backward(ctx, do, _dlse, _dkv):
        dq, dk, dv, none = _grads(ctx, do, _ring_attn_bwd)
        return dq, dk, dv, None, *none


def ring_attn_eager(q: Tensor, k: Tensor, v: Tensor, mask_vis: list[Tensor], **kwargs) -> tuple[Tensor, Tensor, Tensor]:
    """`ring_attn(q, k, v, mask_vis, **kwargs)` in eager mode, by `_EagerRingAttn`."""
    return _EagerRingAttn.apply(q, k, v, kwargs, *mask_vis)
