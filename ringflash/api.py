"""Public entry points: `ring_flash_attn_func` and the `RingFlashAttention` module.

`ring_flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes,
deterministic, return_attn_probs, group, *, layout, ...)`: flash_attn's and ring-flash-attention's
signature, positional order included, on `(B, N, H, D)` tensors; ringflash's own options
(layout, mask, backend, ...) are keyword-only. What flash_attn can do and ringflash cannot
(dropout, ALiBi) is refused by name. `ring_flash_attn_qkvpacked_func` and
`ring_flash_attn_kvpacked_func` take flash_attn's packed layouts. q, k, v are this rank's shard
of the sequence, cut by `ringflash.layout.shard` with the same `layout` (and position ids from
`global_positions`). ring-flash-attention's module names: ringflash/ring_flash_attn.py.
"""

from __future__ import annotations

import inspect
from typing import NoReturn

import torch
import torch.distributed as dist
from torch import nn

from ringflash import allgather_ops, kernels, ops
from ringflash.hybrid import hybrid_attention
from ringflash.inputs import CallOptions, FlashArgs, autocast_inputs, check_local, flash_options, world_size
from ringflash.kernels.checks import resolve_scale
from ringflash.layout import check_layout
from ringflash.masks import RingMask, op_args, window_mask
from ringflash.transport import resolve_transport, ring_comm

__all__ = [
    "RingFlashAttention",
    "ring_flash_attn_func",
    "ring_flash_attn_kvpacked_func",
    "ring_flash_attn_qkvpacked_func",
]


def _check_mask(mask, q, spec: kernels.AttnSpec, layout, world, rank) -> None:
    """A RingMask must describe this call (`spec`: its causal flag and window): raises
    TypeError/ValueError naming `mask`."""
    if not isinstance(mask, RingMask):
        raise TypeError(f"mask must be a ringflash.RingMask (from ring_mask) or None, got {type(mask).__name__}")
    wrong = [
        (name, mine, theirs)
        for name, mine, theirs in (
            ("causal", mask.causal, spec.causal),
            ("layout", mask.layout, layout),
            ("world size", mask.world, world),
            ("rank", mask.rank, rank if rank is not None else mask.rank),
            ("local length", mask.n_local, q.shape[1]),
            ("device", mask.device, q.device),
        )
        if mine != theirs
    ]
    if spec.window is not None and spec.window != mask.window:
        wrong.append(("window", mask.window, spec.window))
    if mask.batch not in (1, q.shape[0]):
        wrong.append(("batch size", mask.batch, q.shape[0]))
    if wrong:
        raise ValueError(
            "mask disagrees with the call: "
            + "; ".join(f"mask's {name} is {m!r}, the call's {c!r}" for name, m, c in wrong)
            + " (build it with ring_mask(..., group=, layout=, causal=, window=, device=q.device) for these inputs)"
        )


def ring_flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool | None = None,
    window_size: tuple[int, int] = (-1, -1),
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    group: dist.ProcessGroup | None = None,
    *,
    layout: str = "zigzag",
    backend: str | None = None,
    check_ranks: bool = True,
    window: int | None = None,
    mask: RingMask | None = None,
    transport: str | None = None,
    head_group: dist.ProcessGroup | None = None,
    scheme: str = "ring",
    heads_k_stride: int = 1,
    softcap: float = 0.0,
    learnable_sink: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, None]:
    """Exact attention over a sequence sharded across the ranks of `group` (docs/api.md).

    Positional order is flash_attn's and ring-flash-attention's; ringflash's own options are keywords.
    Args:
        q: `(B, N_local, H, D)`, this rank's shard of the queries; fp16, bf16 or fp32.
        k, v: `(B, N_local, Hkv, D)` and `(B, N_local, Hkv, Dv)`, same dtype and device; H % Hkv == 0
            (GQA/MQA); v's head dim may differ (DeepSeek's MLA: D = 192, Dv = 128).
        dropout_p: must be 0.0 (no attention dropout).
        softmax_scale: default `1/sqrt(D)`.
        causal: mask by global position, as on the unsharded sequence (None: the mask's, else False).
        window_size: flash_attn's `(left, right)`: with causal `(w - 1, 0)`; without, query i sees
            keys i − left ... i + right by global position (-1: no limit).
        alibi_slopes: must be None (no ALiBi).
        deterministic: the Triton and reference backwards are (what `auto` then runs); refused with cudnn and hopper.
        return_attn_probs: also return `lse (B, H, N_local)` float32, natural log (not
            differentiable): `(o, lse, None)`, as flash_attn does without dropout.
        group: the context-parallel process group; None: the default group, or this process alone.
        layout: how the inputs were sharded, `"zigzag"` (balances causal work) or `"contiguous"`.
        backend: kernels, one of `kernels.BACKENDS`; None reads `RINGFLASH_KERNEL_BACKEND` (auto).
        check_ranks: first check that every rank's call agrees, raising on all of them if not.
        window: the old name of `window_size`, refused on every rank with a TypeError naming it.
        mask: a `RingMask` from `ring_mask` (packed documents and/or a window), built once per batch.
        transport: `"nccl"` or `"copy-engine"` (GPUs of one host); None reads `RINGFLASH_TRANSPORT`. The
            ring's only: with `scheme="allgather"` anything but None raises.
        head_group: head parallelism × ring (ringflash/hybrid.py): `u` ranks that all-to-all heads
            around the ring over `group` (`hybrid_groups`); inputs sharded by `shard(..., head_rank=,
            head_world=)`, `mask` built over `group`. None: the ring alone.
        scheme: `"ring"` (K/V passed around the ring) or `"allgather"` (K/V all-gathered in chunks of
            `heads_k_stride` heads, ringflash/allgather.py; `mask` then from `gather_mask`).
        heads_k_stride: the all-gather's K/V heads per gather, a positive int; the ring raises on any but 1.
        softcap: flash_attn's logit softcapping, scores `c·tanh(s/c)` before the mask; 0.0: none.
        learnable_sink: `(H,)` float32, FlashAttention-4's: a logit per head joining every row's
            softmax with a zero value (gpt-oss). Differentiable; its gradient covers this rank's
            rows, to be reduced over `group` with the model's other replicated gradients.
    Returns:
        o: `(B, N_local, H, Dv)` in q's dtype, or `(o, lse, None)`. Gradients flow to q, k, v.
    """
    options = CallOptions(scheme=scheme, layout=layout, backend=backend, transport=transport,
                          heads_k_stride=heads_k_stride, softcap=softcap, check_ranks=check_ranks)  # fmt: skip
    flash = FlashArgs(dropout_p, window_size, alibi_slopes, deterministic, return_attn_probs)
    return _run(q, k, v, flash, softmax_scale, causal, group, head_group, options, mask, learnable_sink, window)


def _run(q, k, v, flash: FlashArgs, softmax_scale, causal, group, head_group, options: CallOptions, mask,
         learnable_sink, window=None):  # fmt: skip
    """One call, settled: `flash` and `options` as `CallOptions` says, `window` the old name of
    `window_size` (refused where flash_attn's arguments are checked). Dispatches to the scheme,
    alone or inside the head-parallel hybrid."""
    q, k, v = autocast_inputs(q, k, v)
    if options.scheme != "ring":
        return _allgather(q, k, v, flash, softmax_scale, causal, group, head_group, options, mask, learnable_sink,
                          window)  # fmt: skip
    with kernels.device_guard(q):
        if head_group is None:
            return _attend(q, k, v, flash, softmax_scale, causal, group, options, mask=mask, window=window,
                           learnable_sink=learnable_sink)  # fmt: skip
        # All-to-all heads, then the ring over `group` on (B, u·n, H/u, D) blocks.
        spec = None

        def settings():  # the hybrid runs it, inside its checks, before ring(): the spec made here serves both
            nonlocal spec
            fields, spec = _agreed(q, flash, causal, softmax_scale, mask, options, learnable_sink, window)
            return fields

        o, lse = hybrid_attention(
            q, k, v, head_group=head_group, group=group, layout=options.layout, check_ranks=options.check_ranks,
            causal=_causal(causal, mask), settings=settings,
            ring=lambda q, k, v: _attend(
                q, k, v, flash._replace(return_attn_probs=True), softmax_scale, causal, group, options, mask=mask,
                window=window, learnable_sink=ops.sink_slice(learnable_sink, head_group, q.shape[2]), spec=spec,
            )[:2],
        )  # fmt: skip
        return (o, lse, None) if flash.return_attn_probs else o


def _causal(causal, mask) -> bool:
    """`causal=None`: the mask's flag, else False."""
    return causal if causal is not None else (mask.causal if isinstance(mask, RingMask) else False)


def _allgather(q, k, v, flash, softmax_scale, causal, group, head_group, options: CallOptions, mask, learnable_sink,
               window):  # fmt: skip
    """`scheme="allgather"` (ringflash/allgather_ops.py), alone or inside the head-parallel hybrid
    (`head_group`: all-to-all heads, then the all-gather over `group`, each head rank with its
    heads' slice of the sink); an unknown scheme raises on every rank, in `CallOptions.check`
    (the all-gather's checks, or the hybrid's before them)."""
    causal = getattr(mask, "causal", False) if causal is None else causal

    def gather(q, k, v, sink):
        return allgather_ops.attend(q, k, v, flash, softmax_scale, causal, group, options, window=window, mask=mask,
                                    learnable_sink=sink)  # fmt: skip

    def settings():  # the hybrid's grid check: the all-gather's settings, its mask's digest
        fields, _ = _agreed(q, flash, causal, softmax_scale, None, options, learnable_sink, window)
        window_size = getattr(getattr(mask, "call", None), "window_size", fields["window_size"])
        return dict(fields, scheme="allgather", mask_key=getattr(mask, "fingerprint", 0), window_size=window_size)

    with kernels.device_guard(q):
        if head_group is None:
            o, lse = gather(q, k, v, learnable_sink)
        else:
            o, lse = hybrid_attention(
                q, k, v, head_group=head_group, group=group, layout=options.layout,
                check_ranks=options.check_ranks, causal=causal, settings=settings,
                ring=lambda q, k, v: gather(q, k, v, ops.sink_slice(learnable_sink, head_group, q.shape[2])),
            )  # fmt: skip
    return (o, lse, None) if flash.return_attn_probs else o


def _attend(q, k, v, flash: FlashArgs, softmax_scale, causal, group, options: CallOptions, *, mask=None, window=None,
            prepare=None, learnable_sink=None, spec=None):  # fmt: skip
    """The ring's body. `prepare(spec, rank, world) -> (q, k, v, mask)` (`spec`: the call's
    `AttnSpec`, causal and window), if given, turns the caller's inputs into the ring's inside
    the checks, so that its errors too are refused on every rank (the varlen forms of
    ringflash/ring_flash_attn.py). `spec`: that spec, when the caller has already made it from
    these arguments (the hybrid's grid check, `_agreed`)."""
    # Traced, not run, under torch.compile: only the metadata checks happen here; the group is
    # checked (RingComm) and the ranks compared inside the op. Eager checks the group first.
    compiling = torch.compiler.is_compiling()
    layout, check_ranks = options.layout, options.check_ranks
    try:
        transport = resolve_transport(options.transport)
    except ValueError as e:  # told over the default transport, which the others' check waits on
        _refuse(e, None if compiling else ring_comm(group), check_ranks, q, k, causal, layout)
    comm = None if compiling else ring_comm(group, transport)
    world = world_size(group) if compiling else comm.world
    causal = _causal(causal, mask)
    try:
        options.check()
        if spec is None:
            spec = flash_options(*flash, causal, window)
        if prepare is not None:
            q, k, v, mask = prepare(spec, 0 if comm is None else comm.rank, world)
            q, k, v = autocast_inputs(q, k, v)
        scale, kern = check_local(q, k, v, causal, softmax_scale, layout, options.backend, world,
                                  flash.deterministic)
        ops.check_sink(learnable_sink, q)
        if flash.deterministic and not kern.deterministic:
            raise ValueError(
                f"deterministic=True: backend {kern.name!r} is not deterministic; use 'triton' (or 'auto')"
            )
        # Here, not mid-ring with transfers posted: what the kernels cannot run.
        if mask is not None:
            _check_mask(mask, q, spec, layout, world, None if compiling else comm.rank)
        for step in [spec] if mask is None else [st.spec for st in mask.steps if st is not None]:
            kern.check(q, k, v, step.with_softcap(options.softcap))
        if mask is None and spec.window is not None:
            if compiling:  # building a mask is host work Dynamo cannot trace (ringflash/masks.py)
                raise ValueError(
                    "window_size= without mask= cannot be traced by torch.compile: build the mask outside the "
                    "compiled region, ringflash.ring_mask(None, seqlen=N_global, window=window_size, group=..., "
                    "layout=..., device=q.device), and pass mask="
                )
            rank = 0 if world == 1 else dist.get_rank(group)
            mask = window_mask(q.shape[1], spec, rank, world, layout, q.device)
        error = None
    except (TypeError, ValueError) as e:
        scale, kern, error = None, None, e
    if error is not None:
        _refuse(error, comm, check_ranks, q, k, causal, layout)
    vis, mask_kwargs = op_args(mask)
    # A dispatch mode (selective activation checkpointing keeping attention's outputs, FlopCounterMode)
    # sees the ring as one op only through the dispatcher; otherwise the plain autograd.Function
    # saves its host time.
    dispatched = compiling or torch._C._len_torch_dispatch_stack() > 0
    o, lse, _ = (ops.ring_attn if dispatched else ops.ring_attn_eager)(
        q,
        k,
        v,
        vis,
        learnable_sink,
        causal=causal,
        softmax_scale=scale,
        layout=layout,
        group_name=ops.group_name(group),
        backend=kern.name,
        check_ranks=check_ranks,
        transport=transport,
        softcap=float(options.softcap),
        **mask_kwargs,
    )
    return (o, lse, None) if flash.return_attn_probs else o


def _agreed(q, flash: FlashArgs, causal, softmax_scale, mask, options: CallOptions, learnable_sink=None,
            window=None) -> tuple[dict, kernels.AttnSpec]:  # fmt: skip
    """The scheme's settings the hybrid's grid check compares (`agree.row`'s keywords), checked
    here, before its all-to-all, and the call's `AttnSpec`. The all-gather's transport is the
    group's own collectives (nccl)."""
    options.check()
    causal = _causal(causal, mask)
    spec = flash_options(*flash, causal, window)
    kernels.get_backend(options.backend, q.device)  # an unknown name raises here; the backend is not compared
    ops.check_sink(learnable_sink, q)
    fields = dict(
        softcap=options.softcap,
        learnable_sink=learnable_sink,
        window_size=(mask.spec if isinstance(mask, RingMask) else spec).window_size,
        softmax_scale=resolve_scale(softmax_scale, q.shape[-1]),
        mask_key=mask.fingerprint if isinstance(mask, RingMask) else 0,
        transport=resolve_transport("nccl" if options.scheme == "allgather" else options.transport),
    )
    return fields, spec


def _refuse(error: Exception, comm, check_ranks: bool, q, k, causal, layout) -> NoReturn:
    """Raise `error`, this rank's verdict on its own inputs, after telling the other ranks, who
    wait in the op's all_gather (`check_ranks`, several ranks). `comm` is None under
    torch.compile: Dynamo cannot trace that collective, so it gives up on the frame at this
    raise and runs it eagerly, which announces (fullgraph=True cannot: see ring_flash_attn_func)."""
    if comm is not None and check_ranks:  # a ring of one rank too: its grid may wait (ringflash/agree.py)
        ops.announce_rejection(comm, q, k, causal, layout)
    raise error


def ring_flash_attn_qkvpacked_func(
    qkv: torch.Tensor, *args, **kwargs
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, None]:
    """`ring_flash_attn_func` on `qkv (B, N_local, 3, H, D)`, flash_attn's `flash_attn_qkvpacked_func`
    layout (a fused QKV projection's output viewed so). q, k and v are views of it; its gradient
    comes back packed the same way. Every other argument is `ring_flash_attn_func`'s, in its
    order: `(qkv, dropout_p, softmax_scale, causal, window_size, ...)`."""
    return ring_flash_attn_func(*_unpack("qkv", qkv, 3, "heads", args, kwargs), *args, **kwargs)


def ring_flash_attn_kvpacked_func(
    q: torch.Tensor, kv: torch.Tensor, *args, **kwargs
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, None]:
    """`ring_flash_attn_func` on q `(B, N_local, H, D)` and `kv (B, N_local, 2, Hkv, D)`, flash_attn's
    `flash_attn_kvpacked_func` layout (GQA: Hkv divides H). k and v are views of kv; its gradient
    comes back packed the same way. Every other argument is `ring_flash_attn_func`'s, in its
    order: `(q, kv, dropout_p, softmax_scale, causal, window_size, ...)`."""
    return ring_flash_attn_func(q, *_unpack("kv", kv, 2, "kv_heads", args, kwargs), *args, **kwargs)


def _unpack(name: str, packed, n: int, heads: str, args: tuple, kwargs: dict) -> tuple[torch.Tensor, ...]:
    """`packed`'s n views along dim 2; if it is not `(B, N, n, heads, D)`, an error naming it, raised
    after telling the other ranks, as `ring_flash_attn_func` does for its own inputs (`args`,
    `kwargs`: the call's other arguments, for its group and settings)."""
    if isinstance(packed, torch.Tensor) and packed.dim() == 5 and packed.shape[2] == n:
        return packed.unbind(2)
    if isinstance(packed, torch.Tensor):
        error = ValueError(f"{name} must have shape (batch, seqlen, {n}, {heads}, head_dim), got {tuple(packed.shape)}")
    else:
        error = TypeError(f"{name} must be a torch.Tensor, got {type(packed).__name__}")
    call = inspect.signature(ring_flash_attn_func).bind(None, None, None, *args, **kwargs)
    call.apply_defaults()
    a = call.arguments
    comm = None if torch.compiler.is_compiling() else ring_comm(a["group"], resolve_transport(a["transport"]))
    _refuse(error, comm, a["check_ranks"], None, None, a["causal"], a["layout"])


class RingFlashAttention(nn.Module):
    """`ring_flash_attn_func` as a module with fixed settings: `forward(q, k, v, mask=None) -> o`.

    q `(B, N_local, H, D)`, k `(B, N_local, Hkv, D)`, v `(B, N_local, Hkv, Dv)`; o `(B, N_local, H, Dv)` in
    q's dtype. Causal by default (language
    models). With no group and no torch.distributed it is plain single-device attention, so a
    model can hold it unconditionally. `window_size`: flash_attn's `(left, right)` in every call
    (a causal sliding window of w keys is `(w - 1, 0)`; see `ring_flash_attn_func`); `window=`, its
    old name, is refused naming it. `forward(..., mask=)`: this batch's `RingMask` (packed
    documents), whose causal flag must be the module's and whose window must be the module's if it
    has one.
    `transport`: as in `ring_flash_attn_func` (None: `RINGFLASH_TRANSPORT`, read at each call);
    `backend`: the kernels, as in `ring_flash_attn_func` (None: `RINGFLASH_KERNEL_BACKEND`).
    `head_group`: head parallelism around the ring over `group` (`ring_flash_attn_func`'s).
    `scheme`, `heads_k_stride`: ring or all-gather attention (`ring_flash_attn_func`'s).
    `softcap`: logit softcapping in every call; a learnable sink is the caller's tensor (e.g. the
    model's `nn.Parameter`), passed per call: `forward(..., learnable_sink=)`, as in flash_attn.
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        layout: str = "zigzag",
        causal: bool = True,
        softmax_scale: float | None = None,
        backend: str | None = None,
        check_ranks: bool = True,
        window_size: tuple[int, int] = (-1, -1),
        transport: str | None = None,
        *,
        head_group: dist.ProcessGroup | None = None,
        scheme: str = "ring",
        heads_k_stride: int = 1,
        softcap: float = 0.0,
        window: None = None,
    ):
        super().__init__()
        check_layout(layout)
        self.options = CallOptions(scheme=scheme, layout=layout, backend=backend, transport=transport,
                                   heads_k_stride=heads_k_stride, softcap=softcap, check_ranks=check_ranks)  # fmt: skip
        self.options.check()
        kernels.refuse_window(window)
        spec = kernels.AttnSpec.from_window_size(window_size, causal=causal)  # the window enters here, checked once
        if backend is not None:
            named = kernels.backend_named(backend)  # raises on an unknown name
            why = named and named.supports(spec.kind, None, None)
            if why:
                raise ValueError(why)
        self.group, self.head_group, self.causal, self.softmax_scale = group, head_group, causal, softmax_scale
        self.window_size = spec.window_size

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: RingMask | None = None, *,
                learnable_sink: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        flash = FlashArgs(window_size=self.window_size)
        return _run(q, k, v, flash, self.softmax_scale, self.causal, self.group, self.head_group, self.options, mask,
                    learnable_sink)  # fmt: skip

    def extra_repr(self) -> str:
        o = self.options
        window = f", window_size={self.window_size}" if self.window_size != (-1, -1) else ""
        transport = f", transport={o.transport!r}" if o.transport is not None else ""
        scheme = f", scheme={o.scheme!r}" if o.scheme != "ring" else ""
        cap = f", softcap={o.softcap}" if o.softcap else ""
        return f"layout={o.layout!r}, causal={self.causal}{window}, backend={o.backend!r}{transport}{scheme}{cap}"
