"""All-gather attention as custom ops, so that torch.compile traces it as one node, and its call.

`ringflash::allgather_attn` runs `allgather.allgather_forward` and `ringflash::allgather_attn_bwd`
`allgather_backward`; the first is differentiable in q, k, v through the second, and both have
fake implementations, as the ring's ops (ringflash/ops.py), whose conventions they share: the
group travels by name, a mask's per-row intervals as the tensor list `vis` (`[]`: built inside
the op from the group rank, causal and `window_size`, cached), and the cross-rank check runs inside
the op. Eager calls go through `_EagerAllGather`, a plain autograd.Function on the same
functions (no torch.library dispatch on the host).

Softcap and a learnable sink are the ring's: `softcap` rides on every chunk's `AttnSpec`; the
sink (`(H,)` float32, the 5th input) joins each row's softmax once, on the float32 o of all
chunks, by the ring's `ops.add_sink`, and its gradient is `ops.sink_grad` (this rank's rows).

`attend` is `ring_flash_attn_func(..., scheme="allgather")`'s body: the checks, which raise on
every rank (a rank that rejects its inputs tells the others, who wait in the agreement check),
then the op.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ringflash import agree, ops
from ringflash.allgather import GatherMask, allgather_backward, allgather_forward, gather_spec
from ringflash.inputs import CallOptions, FlashArgs, autocast_inputs, check_local, flash_options, world_size
from ringflash.kernels import FULL, AttnSpec, Visibility, device_guard, get_backend
from ringflash.kernels.checks import resolve_scale
from ringflash.transport import ring_comm

__all__ = ["allgather_attn", "allgather_attn_bwd", "attend"]


def _spec(vis: list[Tensor], comm, q, causal, layout, window_size, softcap) -> AttnSpec:
    if vis:
        return AttnSpec(intervals=Visibility(*vis), softcap=softcap)
    window = AttnSpec.from_window_size(window_size or (-1, -1), causal=causal).window
    return gather_spec(q.shape[1], comm.rank, comm.world, layout, causal, window, q.device).with_softcap(softcap)


def _allgather_attn(
    q: Tensor, k: Tensor, v: Tensor, vis: list[Tensor], learnable_sink: Tensor | None = None, *, causal: bool,
    softmax_scale: float, layout: str, group_name: str, backend: str | None, heads_k_stride: int, check_ranks: bool,
    window_size: list[int] | None = None, mask_key: int = 0, softcap: float = 0.0,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """`allgather_forward` over the group named `group_name`: `o (B, N, H, Dv)` in q's dtype, `lse (B, H, N)`
    float32 (the sink's logit included)."""
    with device_guard(q):
        comm = ops._comm(group_name)
        checker = agree.check_comm(comm.group) if check_ranks else None
        if checker is not None and checker.world > 1:
            mine = agree.row(True, "ring attention", comm.world, q=q, k=k, v=v, causal=causal,
                             softmax_scale=softmax_scale, layout=layout, window_size=tuple(window_size or (-1, -1)),
                             mask_key=mask_key, scheme="allgather", softcap=softcap,
                             learnable_sink=learnable_sink)  # fmt: skip
            agree.check(checker, mine)
        # Autocast off: float32 sums by design, as in the ring.
        with torch.autocast(q.device.type, enabled=False):
            o, lse = allgather_forward(
                q, k, v, _spec(vis, comm, q, causal, layout, window_size, softcap), scale=softmax_scale,
                kernels=get_backend(backend, q.device), comm=comm, layout=layout, heads_k_stride=heads_k_stride,
                out_dtype=None if learnable_sink is None else torch.float32,
            )  # fmt: skip
            if learnable_sink is not None:
                o, lse = ops.add_sink(o, lse, learnable_sink, q.dtype)
    return o, lse


allgather_attn = torch.library.custom_op("ringflash::allgather_attn", _allgather_attn, mutates_args=())


@allgather_attn.register_fake
def _(q, k, v, vis, learnable_sink=None, **options):  # the settings of `_allgather_attn`, shapes only
    B, N, H, _ = q.shape
    return q.new_empty((B, N, H, v.shape[3])), q.new_empty((B, H, N), dtype=torch.float32)


def _allgather_attn_bwd(
    do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, vis: list[Tensor], *, causal: bool,
    softmax_scale: float, layout: str, group_name: str, backend: str | None, heads_k_stride: int,
    window_size: list[int] | None = None, softcap: float = 0.0,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """`allgather_backward`: `(dq, dk, dv)` like q, k, v. With a sink, o and lse are the forward's
    (o', lse'): the kernels' delta = rowsum(dO·O') and P from lse' then give the exact gradients."""
    with torch.autocast(q.device.type, enabled=False), device_guard(q):
        comm = ops._comm(group_name)
        spec = _spec(vis, comm, q, causal, layout, window_size, softcap)
        return allgather_backward(
            do.contiguous(), q, k, v, o, lse, spec, scale=softmax_scale, kernels=get_backend(backend, q.device),
            comm=comm, layout=layout, heads_k_stride=heads_k_stride,
        )  # fmt: skip


allgather_attn_bwd = torch.library.custom_op("ringflash::allgather_attn_bwd", _allgather_attn_bwd, mutates_args=())


@allgather_attn_bwd.register_fake
def _(do, q, k, v, o, lse, vis, **options):  # the settings of `_allgather_attn_bwd`, shapes only
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, keyword_only_inputs, output):
    q, k, v, vis, *sink = inputs
    sink = [s for s in sink if s is not None]
    o, lse = output
    ctx.n_vis = len(vis)
    ctx.n_inputs = 4 + len(sink)  # torch.library's pytree drops a None sink, as for the ring op
    ctx.save_for_backward(q, k, v, o, lse, *vis, *sink)
    ctx.kwargs = {key: val for key, val in keyword_only_inputs.items() if key not in ("check_ranks", "mask_key")}
    ctx.mark_non_differentiable(lse)
    ctx.set_materialize_grads(False)


def _grads(ctx, do, backward) -> tuple:
    """dq, dk, dv, the mask's (None) and the sink's, from `backward`: the op, or its function in eager."""
    q, k, v, o, lse, *rest = ctx.saved_tensors
    vis, sink = rest[: ctx.n_vis], rest[ctx.n_vis :]
    if do is None:  # o's gradient is undefined (not materialised): so are q's, k's, v's
        return None, None, None, [None] * len(vis), None
    dsink = ops.sink_grad(do, o, lse, sink[0]) if sink else None
    return *backward(do, q, k, v, o, lse, vis, **ctx.kwargs), [None] * len(vis), dsink


allgather_attn.register_autograd(lambda ctx, do, _dlse: _grads(ctx, do, allgather_attn_bwd)[: ctx.n_inputs],
                                 setup_context=_setup_context)  # fmt: skip


class _EagerAllGather(torch.autograd.Function):
    """The ops' functions under a plain autograd.Function: what eager calls run."""

    @staticmethod
    def forward(ctx, q, k, v, learnable_sink, kwargs, *vis):
        out = _allgather_attn(q, k, v, list(vis), learnable_sink, **kwargs)
        _setup_context(ctx, (q, k, v, list(vis), learnable_sink), kwargs, out)
        return out

    @staticmethod
    def backward(ctx, do, _dlse):
        dq, dk, dv, none, dsink = _grads(ctx, do, _allgather_attn_bwd)
        return dq, dk, dv, dsink, None, *none


# ---- the call (ring_flash_attn_func(..., scheme="allgather")) --------------------------------


def attend(q, k, v, flash: FlashArgs, softmax_scale, causal, group, options: CallOptions, *, window, mask,
           prepare=None, learnable_sink=None):  # fmt: skip
    """`ring_flash_attn_func`'s body for `scheme="allgather"`: returns `(o, lse)`. `flash`, `options`
    and `learnable_sink`: its own, settled where the call entered. `prepare(call, rank, world) ->
    (q, k, v, spec)` (`call`: the call's `AttnSpec`, causal and window), if given, makes the inputs
    and the mask inside the checks (the llama3 varlen forms of ringflash/ring_flash_attn.py), so
    that its errors too raise on every rank; eager only."""
    # Traced, not run, under torch.compile: metadata checks here, the group's and the ranks' in the op.
    compiling = torch.compiler.is_compiling()
    comm = None if compiling else ring_comm(group, "nccl")
    world = world_size(group) if compiling else comm.world
    spec = None
    try:
        options.check()
        call = flash_options(*flash, causal, window)
        if prepare is not None:
            if compiling:
                raise ValueError("the llama3 varlen functions build their mask on the host: call them eagerly")
            q, k, v, spec = prepare(call, comm.rank, world)
            q, k, v = autocast_inputs(q, k, v)  # as ring_flash_attn_func does for its own inputs
        _, kern = check_local(q, k, v, causal, softmax_scale, options.layout, options.backend, world,
                              flash.deterministic)
        ops.check_sink(learnable_sink, q)
        if flash.deterministic and not kern.deterministic:
            raise ValueError(f"deterministic=True: backend {kern.name!r} is not deterministic; use 'triton' or 'auto'")
        if mask is not None:
            _check_gather_mask(mask, q, call, options.layout, world, None if compiling else comm.rank)
            spec, call = mask.spec, mask.call
        dense = spec is FULL if spec is not None else call.kind == "full"
        why = kern.supports("full" if dense else "intervals", q.dtype, q.shape[-1], q.device)
        if why:
            raise ValueError(why)
        kern.check(q, k, v, (FULL if spec is None else spec).with_softcap(options.softcap))  # head dims, dtypes
        error = None
    except (TypeError, ValueError) as e:
        error = e
    if error is not None:
        if comm is not None and options.check_ranks:
            agree.announce(agree.check_comm(group), "ring attention", world, q=q, k=k, causal=causal,
                           layout=options.layout)
        raise error
    vis = [] if spec is None or spec.intervals is None else list(spec.intervals)
    kwargs = dict(causal=causal, softmax_scale=resolve_scale(softmax_scale, q.shape[-1]), layout=options.layout,
                  group_name=ops.group_name(group), backend=kern.name, heads_k_stride=options.heads_k_stride,
                  check_ranks=options.check_ranks, window_size=list(call.window_size),
                  mask_key=0 if mask is None else mask.fingerprint, softcap=float(options.softcap))  # fmt: skip
    if compiling:
        return allgather_attn(q, k, v, vis, learnable_sink, **kwargs)
    return _EagerAllGather.apply(q, k, v, learnable_sink, kwargs, *vis)


def _check_gather_mask(mask, q, call: AttnSpec, layout, world, rank) -> None:
    """A GatherMask must describe this call (`call`: its causal flag and window): raises
    TypeError/ValueError naming `mask`."""
    if not isinstance(mask, GatherMask):
        raise TypeError(
            f"mask: scheme='allgather' takes a ringflash.GatherMask (gather_mask) or None, got {type(mask).__name__}"
        )
    mine = dict(causal=mask.causal, layout=mask.layout, world=mask.world, n_local=mask.n_local)
    theirs = dict(causal=call.causal, layout=layout, world=world, n_local=q.shape[1])
    if rank is not None:
        mine["rank"], theirs["rank"] = mask.rank, rank
    wrong = [f"mask's {n} is {mine[n]!r}, the call's {theirs[n]!r}" for n in mine if mine[n] != theirs[n]]
    if call.window is not None and call.window != mask.window:
        wrong.append(f"mask's window is {mask.window!r}, the call's {call.window!r}")
    lo = mask.spec.intervals.kv_lo if mask.spec.intervals is not None else None
    if lo is not None and (lo.device != q.device or lo.shape[0] not in (1, q.shape[0])):
        wrong.append(f"mask's intervals are {tuple(lo.shape)} on {lo.device}, q is {tuple(q.shape)} on {q.device}")
    if wrong:
        raise ValueError("mask disagrees with the call: " + "; ".join(wrong))
