"""The ring: exact attention of this rank's queries over every rank's keys and values.

W ranks each hold a shard of the sequence (ringflash/layout.py). At step s = 0 … W−1 a rank
holds the key/value block that started on rank (r − s) mod W, computes what the layout's
schedule says for that block pair (full, causal diagonal, half, or nothing), and passes the
block on. One loop serves every layout, causality and mask: a plan (a `layout.Step` or None per
step, from `ring_schedule` or a `RingMask`) supplies each step's query rows, key rows and
`AttnSpec`. A step the plan skips launches nothing, but its K/V (and, backward, dK/dV) still
travel: every rank does the same transfers in the same order. The loop is handed its kernels (a
`kernels.Backend`) and its transport (`comm`), so nothing here chooses either.

Forward: partial `(o, lse)` are merged in float32 (merge.py's math, fused into the forward
kernel through the step API's `acc=`); the last step's kernel writes its rows of o rounded to
q's dtype (`out=`), the other rows are cast.
Backward: the kernels recompute `P = exp(S·scale − lse)` and `delta = rowsum(do·o)` from the
*global* `o` and `lse`, so each block's gradients are exact pieces of the full gradient. dQ
accumulates locally in float32; the float32 dK/dV of each block travel around the ring behind
it, each rank adding its share, and arrive back on the block's home rank after W hops (the
last hop, already finished, in the input dtype). As in the forward, the last step's kernels
write their sums rounded (`acc=`) instead of a cast pass after them.
At W = 2 the last step only reads step 0's results, so these stay in the dtype the backend made
them in (`Backend.partial_dtype`): float32 for the Triton kernels, the input dtype for cuDNN's,
which round (a float32 copy would hold the same values at twice the bytes).

Communication overlaps compute: the transfer for step s+1 is posted before step s computes
(two K/V buffers in turn); on NCCL only if its streams have high priority (ringflash's
`nccl_options`), or the transfers wait for the attention kernels' SMs. The dK/dV kernel of step
s ≥ 1 adds into the accumulator that arrived from the previous rank (no scratch, no separate
`+=`), which is sent on as soon as that kernel is queued, before step s's dQ kernel
(`after_dkdv=`): each hop travels during a dQ kernel, even the last one, with no step after it.
K and V travel packed in one contiguous block (`pack_kv`): one message per step, not two.
"""

from __future__ import annotations

from functools import partial

import torch

from ringflash.kernels import Backend
from ringflash.layout import Step

__all__ = ["kv_views", "pack_kv", "ring_backward", "ring_forward"]

_KV_TAG, _DKV_TAG = 0, 1  # K/V and dK/dV are in flight together in the backward


def pack_kv(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """This rank's K `(B, N, Hkv, D)` and V `(B, N, Hkv, Dv)` as one contiguous block: one message
    per ring step, not two.

    K's elements then V's, shaped `(B, N, Hkv, D + Dv)` so that the block carries both shapes
    (its own indexing means nothing: `kv_views` gives K and V back, each contiguous; with Dv = D
    the bytes are those of `torch.stack((k, v))`). `ring_forward` returns it for the backward,
    which the ring op (ringflash/ops.py) saves instead of k and v (same bytes): the backward's
    ring starts from it without packing again. dK/dV travel packed the same way.
    """
    B, N, Hkv, D = k.shape
    kv = torch.empty((B, N, Hkv, D + v.shape[3]), dtype=k.dtype, device=k.device)
    for dst, src in zip(kv_views(kv, D), (k, v)):
        dst.copy_(src)
    return kv


def kv_views(kv: torch.Tensor, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`(k, v)`: the `(B, N, Hkv, d)` and `(B, N, Hkv, Dv)` views of a block `pack_kv` made (or a
    buffer shaped like one), d being k's head dim."""
    B, N, Hkv, width = kv.shape
    flat = kv.view(-1)
    n_k = B * N * Hkv * d
    return flat[:n_k].view(B, N, Hkv, d), flat[n_k:].view(B, N, Hkv, width - d)


def _ring_buffers(home: torch.Tensor, comm):
    """`buf(s)`: the buffer that holds the block computed at step s.

    Step 0 computes on `home`; later steps alternate between two receive buffers (one when
    W = 2), so `home` is never overwritten and the transfer into one buffer overlaps the compute
    on the other.
    """
    bufs = [home] + [comm.buffer(f"kv{i}", home.shape, home.dtype, home.device) for i in range(min(2, comm.world - 1))]
    return lambda s: bufs[0] if s == 0 else bufs[1 + (s - 1) % 2]


def _check_plan(plan: list[Step | None], comm) -> None:
    if len(plan) != comm.world or plan[0] is None:
        raise ValueError(f"a ring plan needs {comm.world} steps, step 0 computed; got {len(plan)}")


def ring_forward(q, k, v, plan: list[Step | None], *, scale: float, kernels: Backend, comm, out_dtype=None):
    """Ring attention forward, no autograd.

    q `(B, N, H, D)`, k `(B, N, Hkv, D)`, v `(B, N, Hkv, Dv)`: this rank's shard (N local tokens).
    Returns `(o, lse, kv)`: `o (B, N, H, Dv)` in `out_dtype` (default q's; float32 for a caller that
    transforms the merged result before rounding it once) and `lse (B, H, N)` float32, natural log,
    both over the whole sequence, and what `ring_backward` takes for k and v: the block the ring
    sent (`pack_kv`: k and v packed, one message a step), or `(k, v)` on one rank.
    `plan`: a `Step` per ring step or None (skipped): `layout.ring_schedule` or `RingMask.steps`.
    Step 0 must cover every row (it starts the accumulators). `kernels`: a `kernels.Backend`;
    `comm`: a transport (ringflash.transport).
    """
    _check_plan(plan, comm)
    if comm.world == 1:
        return *kernels.fwd_step(q, k, v, plan[0].spec, scale, out_dtype=out_dtype), (k, v)
    kv = pack_kv(k, v)
    comm.reserve(kv)
    d = k.shape[3]
    buf = _ring_buffers(kv, comm)
    last = comm.world - 1
    o = lse = None
    # o rounded to out_dtype (contiguous, whatever q's strides): the last step's kernel writes its rows.
    out = torch.empty((*q.shape[:3], v.shape[3]), dtype=out_dtype or q.dtype, device=q.device)
    partials = _step0_dtype(kernels, q, comm.world)
    for s, step in enumerate(plan):
        cur = kv_views(buf(s), d)
        # Post the next block's transfer first so that it travels while this one is computed.
        transfer = comm.send_recv(buf(s), buf(s + 1), _KV_TAG) if s < last else None
        if step is not None:
            # Step 0 (the diagonal, every query row) starts the accumulators (float32, or at W = 2
            # the backend's partial dtype); later steps merge into their rows inside the kernel
            # (`acc=`): one launch, no extra pass over o. Partial results stay unrounded (but for
            # cuDNN's, kernels/cudnn.py); the last merge writes its rows rounded (`out=`).
            o_lse = kernels.fwd_step(
                q[:, step.q],
                cur[0][:, step.kv],
                cur[1][:, step.kv],
                step.spec,
                scale,
                out_dtype=partials if s == 0 else None,
                acc=None if s == 0 else (o[:, step.q], lse[:, :, step.q]),
                out=out[:, step.q] if s == last else None,
            )
            if s == 0:
                o, lse = o_lse
        if transfer is not None:
            transfer.wait()
    _round_rest(out, o, _last_q_rows(plan))
    return out, lse, kv


def ring_backward(do, q, kv, o, lse, plan: list[Step | None], *, scale: float, kernels: Backend, comm):
    """Ring attention backward, no autograd.

    q `(B, N, H, D)`; do, o `(B, N, H, Dv)`; lse `(B, H, N)` float32; kv: what `ring_forward`
    returned with the global `o` and `lse` (the block it sent, or `(k, v)` on one rank). Returns
    `dq` like q and `dkv`, dK and dV packed as `pack_kv` packs K and V (`kv_views` splits it), in
    the input dtype, accumulated in float32 across the ring. (Packed because they come home as
    one message.)
    `plan`, `kernels`, `comm`: as in `ring_forward` (the same ones).
    """
    _check_plan(plan, comm)
    if comm.world == 1:
        k, v = kv
        dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        dkv = torch.empty((*k.shape[:3], k.shape[3] + v.shape[3]), dtype=k.dtype, device=q.device)
        kernels.bwd_step(do, q, k, v, o, lse, plan[0].spec, scale, out=(dq, *kv_views(dkv, k.shape[3])))
        return dq, dkv
    world = comm.world
    last = world - 1
    d = q.shape[3]
    comm.reserve(kv)
    buf = _ring_buffers(kv, comm)
    # dK/dV travel in float32: rounding each hop to bf16 would lose what the sum needs (at W = 2
    # the one hop before the last carries step 0's result as it came: `_step0_dtype`).
    partials = _step0_dtype(kernels, q, world)
    dkv = comm.buffer("dkv", (2, *kv.shape), partials, kv.device)
    dq = torch.empty(q.shape, dtype=partials, device=q.device)
    # The results in the input dtype, made at the last step (not to raise the peak), whose kernels
    # read the sums and write them rounded (`attn_bwd(acc=...)`): no separate cast pass.
    # The last hop carries finished dK/dV: rounded before sending, bit-identical to rounding at
    # home and half the bytes for bf16/fp16.
    dq_out = dkv_out = None
    sent = home = None  # the dK/dV transfer in flight; where the last hop brings ours

    def pass_on(s: int, kv_rows: slice | None) -> None:
        """Step s's dK/dV are in their block's accumulator (the kernel added them): send it on.

        Called between the dK/dV and the dQ kernels of step s (`after_dkdv=`), so
        the transfer travels while dQ is computed: even the last hop, which no later step could
        hide, and the one step s+1's dK/dV kernel waits for. `kv_rows`: the rows step s computed
        (None: none), which on the last step its kernel has already rounded into `dkv_out`.
        """
        nonlocal sent, home
        acc = dkv[s % 2]
        if s < last:
            sent = comm.send_recv(acc, dkv[(s + 1) % 2], _DKV_TAG)
            return
        for out, grad in zip(kv_views(dkv_out, d), kv_views(acc, d)):  # apart: each contiguous, copied faster
            _round_rest(out, grad, kv_rows)
        home = comm.buffer("home", kv.shape, kv.dtype, kv.device)
        sent = comm.send_recv(dkv_out, home, _DKV_TAG)

    for s, step in enumerate(plan):
        cur = kv_views(buf(s), d)
        kv_transfer = comm.send_recv(buf(s), buf(s + 1), _KV_TAG) if s < last else None
        if sent is not None:
            # This block's accumulator has arrived (and the other buffer has left, so it may
            # receive again). It travelled during the previous step's dQ. (Adding in the kernel
            # needs it before this step's dK/dV, not after, and saves a float32 scratch block.)
            sent.wait()
        if s == last:
            dq_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
            dkv_out = torch.empty(kv.shape, dtype=kv.dtype, device=kv.device)
        if step is None:
            pass_on(s, None)  # nothing to add, but the accumulator still travels on
        else:
            qs, ks = step.q, step.kv
            acc = kv_views(dkv[s % 2], d)  # ours at s = 0, where step 0 (the diagonal, every row) starts it
            # Step 0 writes dq and this block's dK/dV; later steps add theirs to the float32 sums,
            # in place, except the last, which writes the totals rounded.
            sums = (dq[:, qs], acc[0][:, ks], acc[1][:, ks])
            if s < last:
                out, grad_dtype = sums, partials
            else:
                dk_out, dv_out = kv_views(dkv_out, d)
                out, grad_dtype = (dq_out[:, qs], dk_out[:, ks], dv_out[:, ks]), q.dtype
            kernels.bwd_step(
                do[:, qs],
                q[:, qs],
                cur[0][:, ks],
                cur[1][:, ks],
                o[:, qs],
                lse[:, :, qs],
                step.spec,
                scale,
                grad_dtype=grad_dtype,
                out=out,
                acc=sums if s > 0 else None,
                after_dkdv=partial(pass_on, s, ks),
            )
        if kv_transfer is not None:
            kv_transfer.wait()
    sent.wait()
    _round_rest(dq_out, dq, _last_q_rows(plan))
    return dq_out, comm.keep(home)


def _step0_dtype(kernels: Backend, q: torch.Tensor, world: int) -> torch.dtype:
    """The dtype step 0 writes its o / gradients in: float32, to which later steps add; at W = 2 the
    last step only reads them, so they stay as the backend made them (`Backend.partial_dtype`)."""
    return kernels.partial_dtype(q.dtype) if world == 2 else torch.float32


def _last_q_rows(plan) -> slice | None:
    """The local query rows the plan's last step computes; None if it skips."""
    return None if plan[-1] is None else plan[-1].q


def _round_rest(out: torch.Tensor, sums: torch.Tensor, rows: slice | None) -> None:
    """`out (B, N, H, D)` (any head dim) = `sums` (float32, or already in out's dtype) rounded, outside `rows` (the
    last step's kernels wrote those already; None: all of it)."""
    if rows is not None and rows.step not in (None, 1):
        raise ValueError(f"a ring step's rows are a contiguous slice, got {rows}")
    start, stop = (0, 0) if rows is None else rows.indices(out.shape[1])[:2]
    for lo, hi in ((0, start), (stop, out.shape[1])):
        if lo < hi:
            out[:, lo:hi].copy_(sums[:, lo:hi])
