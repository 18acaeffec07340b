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
(5 per step; empty without a mask), and, for the cross-rank check, its window as flash_attn's
`window_size` and its `mask_key` (a hash of its global definition: documents' boundaries, window,
layout, world). `masks.op_args` encodes a mask so and `masks.decode` decodes it (to the mask's
own steps while it lives: nothing is rebuilt per call).
Under torch.compile the ints are constants of the graph: a batch whose plan differs (other
skipped steps or rows) recompiles; the tensors are inputs and change freely.

Softcap (`softcap=`) goes to every step's `AttnSpec`, which the kernels read. A learnable sink
(`learnable_sink (H,)` float32, the 5th input) is one more logit per head with a zero value: it
joins each row's softmax once, after the ring's merge, `lse' = logaddexp(lse, sink)`,
`o' = o·exp(lse − lse')` on the float32 o (rounded to q's dtype once, after it, as o is without a
sink), and (o', lse') are saved, so the ring's backward (which recomputes P
from the lse it is given and `delta = rowsum(dO·O')`) gives the exact dq, dk, dv. Its gradient,
`dsink_h = −Σ_rows exp(sink_h − lse')·rowsum(dO·O')`, sums this rank's rows only: the sink is
replicated over the context-parallel group, and whoever reduces the model's gradients over that
group (as for every other replicated parameter) adds the ranks' shares. The all-gather
(ringflash/allgather_ops.py) applies the sink the same way, by `add_sink` and `sink_grad`.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch import Tensor

from ringflash import agree
from ringflash.kernels import device_guard, get_backend
from ringflash.layout import ring_schedule
from ringflash.masks import decode
from ringflash.ring import kv_views, ring_backward, ring_forward
from ringflash.transport import Transport, ring_comm

__all__ = [
    "add_sink", "announce_rejection", "check_sink", "group_name", "keep_attention_outputs", "ring_attn",
    "ring_attn_bwd", "ring_attn_eager", "sink_grad", "sink_slice",
]


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


def _plan(comm: Transport, q: Tensor, causal: bool, layout: str, mask_plan, mask_vis, softcap: float = 0.0) -> list:
    """The ring's steps: a mask's (decoded from the op's arguments), or the layout's schedule; each
    step's spec carries `softcap` (kernels/spec.py)."""
    if mask_plan:
        plan = decode(list(mask_plan), list(mask_vis))
    else:
        plan = ring_schedule(comm.rank, comm.world, q.shape[1], causal, layout)
    if not softcap:
        return plan
    return [None if st is None else dataclasses.replace(st, spec=st.spec.with_softcap(softcap)) for st in plan]


def sink_slice(sink: torch.Tensor | None, head_group, heads: int) -> torch.Tensor | None:
    """The hybrid's head rank j runs heads [j·heads, (j+1)·heads): its slice of the sink (checked whole
    before, in `_agreed`), differentiable so that each slice's gradient lands in its own entries."""
    if sink is None:
        return None
    j = dist.get_rank(head_group)
    return sink[j * heads : (j + 1) * heads]


def check_sink(sink, q) -> None:
    """`learnable_sink` must be None or a float32 `(H,)` tensor on q's device; raises naming it."""
    if sink is None:
        return
    if not isinstance(sink, torch.Tensor):
        raise TypeError(f"learnable_sink must be a torch.Tensor (H,) or None, got {type(sink).__name__}")
    if sink.shape != (q.shape[2],):
        raise ValueError(
            f"learnable_sink must have shape (H,) = ({q.shape[2]},), one logit per query head, got {tuple(sink.shape)}"
        )
    if sink.dtype != torch.float32:
        raise TypeError(f"learnable_sink must be float32 (FlashAttention-4's), got {sink.dtype}")
    if sink.device != q.device:
        raise ValueError(f"learnable_sink must be on q's device {q.device}, got {sink.device}")


def add_sink(o: Tensor, lse: Tensor, sink: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """`(o', lse')`: the sink `(H,)` joins each row's softmax (o `(B, N, H, Dv)` float32 over every key,
    lse `(B, H, N)`), o' rounded to `dtype` once."""
    new = torch.logaddexp(lse, sink.float().view(1, -1, 1))  # finite wherever the sink is
    weight = torch.exp(lse - new).transpose(1, 2).unsqueeze(-1)  # (B, N, H, 1); 0 for rows that saw no key
    return (o * weight).to(dtype), new


def sink_grad(do: Tensor, o: Tensor, lse: Tensor, sink: Tensor) -> Tensor:
    """dsink `(H,)` over this rank's rows: −Σ exp(sink − lse')·rowsum(dO·O') (module docstring)."""
    delta = (do.float() * o.float()).sum(-1).transpose(1, 2)  # (B, H, N)
    p_sink = torch.exp(sink.float().view(1, -1, 1) - lse)
    return -(p_sink * delta).sum((0, 2)).to(sink.dtype)


# ---- the ops ----------------------------------------------------------------------------------


def _ring_attn(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask_vis: list[Tensor],
    learnable_sink: Tensor | None = None,
    *,
    causal: bool,
    softmax_scale: float,
    layout: str,
    group_name: str,
    backend: str | None,
    check_ranks: bool,
    mask_plan: list[int] | None = None,
    mask_key: int = 0,
    transport: str = "nccl",
    softcap: float = 0.0,
    window_size: list[int] | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """`ring.ring_forward` over the group named `group_name`.

    Returns `o (B, N, H, Dv)` in q's dtype, `lse (B, H, N)` float32, and what the backward needs
    of k and v: the packed buffer the ring started from (`ring.pack_kv`) (saved so that the backward's ring
    need not pack again), or an empty tensor on one rank (the backward then takes k and v).
    `mask_vis`, `mask_plan`, `mask_key`, `window_size`: a `RingMask` (module docstring; the window
    itself is in the plan). `transport`: how the blocks travel (`ringflash.transport.TRANSPORTS`).
    `softcap`, `learnable_sink`: module docstring.
    """
    with device_guard(q):  # the transport's streams and buffers and every launch on q's GPU
        comm = _comm(group_name, transport)
        checker = agree.check_comm(comm.group) if check_ranks else None
        if checker is not None and checker.world > 1:  # the whole grid when the group is part of one: a ring of one too
            mine = agree.row(True, "ring attention", comm.world, q=q, k=k, v=v, causal=causal,
                             softmax_scale=softmax_scale, layout=layout, mask_key=mask_key, transport=comm.name,
                             window_size=tuple(window_size or (-1, -1)), softcap=softcap,
                             learnable_sink=learnable_sink)  # fmt: skip
            agree.check(checker, mine)
        plan = _plan(comm, q, causal, layout, mask_plan, mask_vis, softcap)
        # Autocast off: the merge and accumulators are float32 by design, and the reference kernel's
        # float32 einsums must not be recast to half precision.
        with torch.autocast(q.device.type, enabled=False):
            kern = get_backend(backend, q.device)
            o, lse, kv = ring_forward(q, k, v, plan, scale=softmax_scale, kernels=kern, comm=comm,
                                      out_dtype=None if learnable_sink is None else torch.float32)
            if learnable_sink is not None:  # once per row, after the merge of every ring step
                o, lse = add_sink(o, lse, learnable_sink, q.dtype)
    return o.contiguous(), lse.contiguous(), kv if comm.world > 1 else q.new_empty(0)


ring_attn = torch.library.custom_op("ringflash::ring_attn", _ring_attn, mutates_args=())


@ring_attn.register_fake
def _(q, k, v, mask_vis, learnable_sink=None, **options):  # the settings of `_ring_attn`, shapes only
    B, N, H, _ = q.shape
    world = _comm(options["group_name"]).world  # a trace-time constant, like every shape here
    return (
        q.new_empty((B, N, H, v.shape[3])),
        q.new_empty((B, H, N), dtype=torch.float32),
        k.new_empty(_packed_shape(k.shape, v.shape)) if world > 1 else q.new_empty(0),
    )


def _packed_shape(kshape, vshape) -> tuple[int, ...]:
    """The shape `ring.pack_kv` gives K and V (and dK and dV) packed."""
    return (*kshape[:3], kshape[3] + vshape[3])


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
    softcap: float = 0.0,
) -> tuple[Tensor, Tensor]:
    """`ring.ring_backward`: `dq` like q and `dkv` (dK, dV packed as `ring.pack_kv` packs K and V,
    as they come home in one message; the autograd formula splits them, outside the op, without a
    copy).

    `kv` is `[packed]` as `ring_attn` returned it, or `[k, v]` on one rank.
    """
    with torch.autocast(q.device.type, enabled=False), device_guard(q):
        comm = _comm(group_name, transport)
        return ring_backward(
            do.contiguous(), q, kv[0] if len(kv) == 1 else tuple(kv), o, lse,
            _plan(comm, q, causal, layout, mask_plan, mask_vis, softcap),
            scale=softmax_scale, kernels=get_backend(backend, q.device), comm=comm,
        )  # fmt: skip


ring_attn_bwd = torch.library.custom_op("ringflash::ring_attn_bwd", _ring_attn_bwd, mutates_args=())


@ring_attn_bwd.register_fake
def _(do, q, kv, o, lse, mask_vis, **options):  # the settings of `_ring_attn_bwd`, shapes only
    shape = kv[0].shape if len(kv) == 1 else _packed_shape(kv[0].shape, kv[1].shape)
    return q.new_empty(q.shape), q.new_empty(shape)


def _setup_context(ctx, inputs, keyword_only_inputs, output):
    q, k, v, mask_vis, *sink = inputs
    sink = [s for s in sink if s is not None]
    o, lse, kv = output
    # The packed buffer, or k and v themselves on one rank (kv is then empty); then the mask's
    # Visibility tensors; then the sink, if any.
    kvs = [kv] if kv.numel() else [k, v]
    ctx.n_kv, ctx.n_vis = len(kvs), len(mask_vis)
    # torch.library's pytree of the inputs drops a None sink: the backward returns no gradient for it.
    ctx.n_inputs = 4 + len(sink)
    ctx.save_for_backward(q, o, lse, *kvs, *mask_vis, *sink)
    drop = ("check_ranks", "mask_key", "window_size")  # the cross-rank check ran in the forward
    ctx.kwargs = {key: val for key, val in keyword_only_inputs.items() if key not in drop}
    ctx.mark_non_differentiable(lse, kv)
    # lse and kv never get a gradient: without this autograd would hand the backward zeros the
    # size of kv, a memset as large as K and V per call. o's gradient may then be None too
    # (`_grads`).
    ctx.set_materialize_grads(False)


def _grads(ctx, do, backward) -> tuple:
    """dq, dk, dv, the mask's (None) and the sink's from `backward`: the backward op, or its function
    in eager."""
    q, o, lse, *rest = ctx.saved_tensors
    kv, mask_vis, sink = rest[: ctx.n_kv], rest[ctx.n_kv : ctx.n_kv + ctx.n_vis], rest[ctx.n_kv + ctx.n_vis :]
    if do is None:  # o's gradient is undefined (grads are not materialised): so are q's, k's, v's
        return None, None, None, [None] * len(mask_vis), None
    dq, dkv = backward(do, q, kv, o, lse, mask_vis, **ctx.kwargs)
    dsink = sink_grad(do, o, lse, sink[0]) if sink else None
    return dq, *kv_views(dkv, q.shape[3]), [None] * len(mask_vis), dsink


ring_attn.register_autograd(
    lambda ctx, do, _dlse, _dkv: _grads(ctx, do, ring_attn_bwd)[: ctx.n_inputs], setup_context=_setup_context
)


class _EagerRingAttn(torch.autograd.Function):
    """The ops' functions under a plain autograd.Function: what eager calls run.

    Same forward, backward and saved tensors as `ring_attn`, without torch.library's dispatch
    (argument defaults, pytrees, the Dynamo guard around the implementation): host time that small
    blocks make the GPU wait for, since at 8k a call's host time is close to its GPU time.
    Under torch.compile `ring_flash_attn_func` calls the op, which Dynamo sees as one node.
    """

    @staticmethod
    def forward(ctx, q, k, v, learnable_sink, kwargs, *mask_vis):
        mask_vis = list(mask_vis)
        out = _ring_attn(q, k, v, mask_vis, learnable_sink, **kwargs)
        _setup_context(ctx, (q, k, v, mask_vis, learnable_sink), kwargs, out)
        return out

    @staticmethod
    def backward(ctx, do, _dlse, _dkv):
        dq, dk, dv, none, dsink = _grads(ctx, do, _ring_attn_bwd)
        return dq, dk, dv, dsink, None, *none


def ring_attn_eager(
    q: Tensor, k: Tensor, v: Tensor, mask_vis: list[Tensor], learnable_sink: Tensor | None = None, **kwargs
) -> tuple[Tensor, Tensor, Tensor]:
    """`ring_attn(q, k, v, mask_vis, learnable_sink, **kwargs)` in eager mode, by `_EagerRingAttn`."""
    return _EagerRingAttn.apply(q, k, v, learnable_sink, kwargs, *mask_vis)


def keep_attention_outputs():
    """`context_fn` for `torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`: keep the
    outputs of ringflash's attention (the ring, the all-gather, one device's kernels) through
    activation checkpointing and recompute the rest, so that the backward does not run attention,
    and its transfers, again. Costs each call's output, LSE and the K/V that came home.
    (`ringflash.api` calls the ring through the dispatcher while the policy's mode is active.)"""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(_keep_attention)


def _keep_attention(ctx, op, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy

    ours = torch.ops.ringflash
    keep = op in (ours.ring_attn.default, ours.allgather_attn.default, ours.attn_fwd.default)
    return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE
