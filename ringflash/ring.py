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
it, each rank adding its share. The backward visits the blocks one step later than the forward
(step s holds the block of rank r − 1 − s: the previous rank's first, its own last), so each
block's sums start on the rank after its home and arrive home with the last step, whose kernels
write them rounded (`acc=`, as the last step's dQ): W − 1 dK/dV hops, none after the last step,
which nothing could hide. The forward keeps the block it received first (the previous rank's)
for this, instead of its own, which comes back around the ring.
At W = 2 the last step only reads step 0's results, so these stay in the dtype the backend made
them in (`Backend.partial_dtype`): float32 for the Triton kernels, the input dtype for cuDNN's,
which round (a float32 copy would hold the same values at twice the bytes).

Communication overlaps compute: the transfer for step s+1 is posted before step s computes
(two K/V buffers in turn); on NCCL only if its streams have high priority (ringflash's
`nccl_options`), or the transfers wait for the attention kernels' SMs. Step s ≥ 1 adds its
block's dK/dV into the accumulator that arrived from the previous rank and sends it on as soon
as the addition is queued (`after_dkdv=`). Where the sums are first read is the backend's
(`acc_ready=`, where the step waits for them): the Triton dK/dV kernel adds them in its epilogue,
so it waits before its launch and the hop travels during the previous step's dQ kernel; the
one-kernel backwards (`hopper`, `cudnn`) have no dQ kernel to hide it behind, so they add after
their kernel, and the hop travels during the next step's kernel.
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


def _ring_buffers(home: torch.Tensor, comm, hold: bool = False):
    """`buf(s)`: the buffer that holds the block computed at step s.

    Step 0 computes on `home`; later steps alternate between two receive buffers (one when
    W = 2), so `home` is never overwritten and the transfer into one buffer overlaps the compute
    on the other. `hold`: step 1's buffer is not reused (the forward keeps that block for the
    backward); steps 2, 3, … alternate between two others.
    """
    held = hold and comm.world > 3  # below 4 ranks no later step would reuse it
    n = min(2, comm.world - 1) + held
    bufs = [home] + [comm.buffer(f"kv{i}", home.shape, home.dtype, home.device) for i in range(n)]
    own, turn = bufs[: 1 + held], bufs[1 + held :]  # the steps with a buffer of their own; the rest alternate
    return lambda s: own[s] if s < len(own) else turn[(s - len(own)) % len(turn)]


def _check_plan(plan: list[Step | None], comm) -> None:
    if len(plan) != comm.world or plan[0] is None:
        raise ValueError(f"a ring plan needs {comm.world} steps, step 0 computed; got {len(plan)}")


def ring_forward(q, k, v, plan: list[Step | None], *, scale: float, kernels: Backend, comm, out_dtype=None):
    """Ring attention forward, no autograd.

    q `(B, N, H, D)`, k `(B, N, Hkv, D)`, v `(B, N, Hkv, Dv)`: this rank's shard (N local tokens).
    Returns `(o, lse, kv)`: `o (B, N, H, Dv)` in `out_dtype` (default q's; float32 for a caller that
    transforms the merged result before rounding it once) and `lse (B, H, N)` float32, natural log,
    both over the whole sequence, and what `ring_backward` takes for k and v: the block received
    first, the previous rank's (`pack_kv`: k and v packed, one message a step; the backward starts
    from it), or `(k, v)` on one rank.
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
    buf = _ring_buffers(kv, comm, hold=True)
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
    _round_rest(out, o, _rows(plan[-1]))
    return out, lse, comm.keep(buf(1))


def ring_backward(do, q, kv, o, lse, plan: list[Step | None], *, scale: float, kernels: Backend, comm):
    """Ring attention backward, no autograd.

    q `(B, N, H, D)`; do, o `(B, N, H, Dv)`; lse `(B, H, N)` float32; kv: what `ring_forward`
    returned with the global `o` and `lse` (the previous rank's block, or `(k, v)` on one rank).
    Returns `dq` like q and `dkv`, dK and dV of this rank's block packed as `pack_kv` packs K and
    V (`kv_views` splits it), in the input dtype, accumulated in float32 across the ring.
    `plan`, `kernels`, `comm`: as in `ring_forward` (the same ones: step s here is its step s + 1).
    """
    _check_plan(plan, comm)
    if comm.world == 1:
        k, v = kv
        dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        dkv = torch.empty((*k.shape[:3], k.shape[3] + v.shape[3]), dtype=k.dtype, device=q.device)
        kernels.bwd_step(do, q, k, v, o, lse, plan[0].spec, scale, out=(dq, *kv_views(dkv, k.shape[3])))
        return dq, dkv
    last = comm.world - 1
    d = q.shape[3]
    steps = plan[1:] + plan[:1]  # the block the forward kept (the previous rank's) first, our own last
    comm.reserve(kv)
    buf = _ring_buffers(kv, comm)
    # dK/dV travel in float32: rounding each hop to bf16 would lose what the sum needs (at W = 2
    # the one hop carries step 0's result as it came: `_step0_dtype`).
    partials = _step0_dtype(kernels, q, comm.world)
    dkv = comm.buffer("dkv", (2, *kv.shape), partials, kv.device)
    dq = torch.empty(q.shape, dtype=partials, device=q.device)
    # Step 0 writes the rows it computes and starts the sums; the rows it does not see start at zero.
    _zero_rest(dq, _rows(steps[0], "q"))
    for grad in kv_views(dkv[0], d):
        _zero_rest(grad, _rows(steps[0], "kv"))
    sent = None  # the dK/dV transfer in flight

    def pass_on(s: int) -> None:
        """Step s's dK/dV are in their block's accumulator (the kernel added them): send it on.

        Called between the dK/dV and the dQ kernels of step s (`after_dkdv=`), so the transfer
        travels while dQ is computed. The last step's are ours: they stay.
        """
        nonlocal sent
        if s < last:
            sent = comm.send_recv(dkv[s % 2], dkv[(s + 1) % 2], _DKV_TAG)

    for s, step in enumerate(steps):
        cur = kv_views(buf(s), d)
        kv_transfer = comm.send_recv(buf(s), buf(s + 1), _KV_TAG) if s < last else None
        # This block's accumulator has arrived once `sent` is waited for (and the other buffer has
        # left, so it may receive again): here for a skipped step, else where the backend first
        # reads the sums (`acc_ready`).
        if step is None:
            if sent is not None:
                sent.wait()
            pass_on(s)  # nothing to add, but the accumulator still travels on
        else:
            qs, ks = step.q, step.kv
            dk, dv = kv_views(dkv[s % 2], d)
            # Later steps add to the float32 sums in place, but the last, which writes our block's
            # dK/dV and dQ rounded: the results, without a cast pass or a hop after it.
            sums = (dq[:, qs], dk[:, ks], dv[:, ks])
            if s < last:
                out, grad_dtype = sums, partials
            else:
                dq_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
                dkv_out = torch.empty(kv.shape, dtype=kv.dtype, device=kv.device)
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
                acc_ready=None if sent is None else sent.wait,
                after_dkdv=partial(pass_on, s),
            )
        if kv_transfer is not None:
            kv_transfer.wait()
    _round_rest(dq_out, dq, _rows(steps[-1], "q"))
    for out, grad in zip(kv_views(dkv_out, d), kv_views(dkv[last % 2], d)):  # apart: each contiguous, copied faster
        _round_rest(out, grad, _rows(steps[-1], "kv"))
    return dq_out, dkv_out


def _step0_dtype(kernels: Backend, q: torch.Tensor, world: int) -> torch.dtype:
    """The dtype step 0 writes its o / gradients in: float32, to which later steps add; at W = 2 the
    last step only reads them, so they stay as the backend made them (`Backend.partial_dtype`)."""
    return kernels.partial_dtype(q.dtype) if world == 2 else torch.float32


def _rows(step: Step | None, which: str = "q") -> slice | None:
    """The local query (`which="q"`) or key rows a step computes; None if it is skipped."""
    return None if step is None else getattr(step, which)


def _outside(rows: slice | None, n: int) -> list[tuple[int, int]]:
    """The row ranges of `range(n)` outside `rows` (a contiguous slice; None: all of them)."""
    if rows is not None and rows.step not in (None, 1):
        raise ValueError(f"a ring step's rows are a contiguous slice, got {rows}")
    start, stop = (0, 0) if rows is None else rows.indices(n)[:2]
    return [(lo, hi) for lo, hi in ((0, start), (stop, n)) if lo < hi]


def _round_rest(out: torch.Tensor, sums: torch.Tensor, rows: slice | None) -> None:
    """`out (B, N, H, D)` (any head dim) = `sums` (float32, or already in out's dtype) rounded, outside `rows` (the
    last step's kernels wrote those already; None: all of it)."""
    for lo, hi in _outside(rows, out.shape[1]):
        out[:, lo:hi].copy_(sums[:, lo:hi])


def _zero_rest(sums: torch.Tensor, rows: slice | None) -> None:
    """Zero `sums (B, N, H, D)` outside `rows` (those the first step writes)."""
    for lo, hi in _outside(rows, sums.shape[1]):
        sums[:, lo:hi].zero_()
