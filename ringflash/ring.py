"""The ring: exact attention of this rank's queries over every rank's keys and values.

W ranks each hold a shard of the sequence (ringflash/layout.py). At step s = 0 … W−1 a rank
holds the key/value block that started on rank (r − s) mod W, computes what the layout's
schedule says for that block pair (full, causal diagonal, half, or nothing), and passes the
block on. One loop serves every layout and causality; `ring_schedule` supplies each step's
query rows, key rows and causal flag.

Forward: partial `(o, lse)` are merged in float32 (merge.py); o is cast once to q's dtype.
Backward: the kernels recompute `P = exp(S·scale − lse)` and `delta = rowsum(do·o)` from the
*global* `o` and `lse`, so each block's gradients are exact pieces of the full gradient. dQ
accumulates locally in float32; the float32 dK/dV of each block travel around the ring behind
it, each rank adding its share, and arrive back on the block's home rank after W hops (the
last hop, already finished, in the input dtype).

Communication overlaps compute: the transfer for step s+1 is posted before step s computes
(two K/V buffers in turn), and the dK/dV of step s travel during step s+1. K and V travel packed
in one contiguous `(2, B, N, Hkv, D)` buffer: one message per step instead of two.
"""

from __future__ import annotations

import torch

from kernels import attn_bwd, attn_fwd
from ringflash.layout import ring_schedule
from ringflash.merge import merge

__all__ = ["RingFlashAttnFunc", "ring_backward", "ring_forward"]

_KV_TAG, _DKV_TAG = 0, 1  # K/V and dK/dV are in flight together in the backward


def _packed_kv(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Two K/V buffers `(2 buffers, 2 = k|v, B, N, Hkv, D)`, the first holding this rank's k, v."""
    bufs = torch.empty((2, 2, *k.shape), dtype=k.dtype, device=k.device)
    bufs[0, 0].copy_(k)
    bufs[0, 1].copy_(v)
    return bufs


def ring_forward(q, k, v, *, causal: bool, scale: float, layout: str, comm, backend: str | None = None):
    """Ring attention forward, no autograd.

    q `(B, N, H, D)`, k, v `(B, N, Hkv, D)`: this rank's shard (N local tokens).
    Returns `o (B, N, H, D)` in q's dtype and `lse (B, H, N)` float32, natural log, both over the
    whole sequence. `comm` is a `RingComm` (or `NullComm`); `backend` goes to `kernels.attn_fwd`.
    """
    if comm.world == 1:
        return attn_fwd(q, k, v, causal=causal, softmax_scale=scale, backend=backend)
    steps = ring_schedule(comm.rank, comm.world, q.shape[1], causal, layout)
    kv = _packed_kv(k, v)
    o = lse = None
    for s, step in enumerate(steps):
        cur, nxt = kv[s % 2], kv[(s + 1) % 2]
        # Post the next block's transfer first so that it travels while this one is computed.
        transfer = comm.send_recv(cur, nxt, _KV_TAG) if s + 1 < comm.world else None
        if step is not None:
            o_blk, lse_blk = attn_fwd(
                q[:, step.q],
                cur[0][:, step.kv],
                cur[1][:, step.kv],
                causal=step.causal,
                softmax_scale=scale,
                out_dtype=torch.float32,  # partial results stay unrounded until the last merge
                backend=backend,
            )
            if s == 0:  # the diagonal block covers every query row: start the accumulators
                o, lse = o_blk, lse_blk
            else:
                merge(o[:, step.q], lse[:, :, step.q], o_blk, lse_blk)
        if transfer is not None:
            transfer.wait()
    return o.to(q.dtype), lse


def ring_backward(do, q, k, v, o, lse, *, causal: bool, scale: float, layout: str, comm, backend: str | None = None):
    """Ring attention backward, no autograd.

    do, q, o `(B, N, H, D)`; k, v `(B, N, Hkv, D)`; lse `(B, H, N)` float32 — the global `o` and
    `lse` that `ring_forward` returned. Returns `dq` like q, `dk`, `dv` like k (input dtype),
    accumulated in float32 across the ring.
    """
    if comm.world == 1:
        return attn_bwd(do, q, k, v, o, lse, causal=causal, softmax_scale=scale, backend=backend)
    world = comm.world
    steps = ring_schedule(comm.rank, world, q.shape[1], causal, layout)
    kv = _packed_kv(k, v)
    # dK/dV travel in float32: rounding each hop to bf16 would lose what the sum needs.
    dkv = torch.empty((2, 2, *k.shape), dtype=torch.float32, device=k.device)
    dq = None
    dkv_transfer = None
    for s, step in enumerate(steps):
        cur, nxt = kv[s % 2], kv[(s + 1) % 2]
        kv_transfer = comm.send_recv(cur, nxt, _KV_TAG) if s + 1 < world else None
        if step is not None:
            qs, ks = step.q, step.kv
            dq_blk, dk_blk, dv_blk = attn_bwd(
                do[:, qs],
                q[:, qs],
                cur[0][:, ks],
                cur[1][:, ks],
                o[:, qs],
                lse[:, :, qs].contiguous(),
                causal=step.causal,
                softmax_scale=scale,
                grad_dtype=torch.float32,
                backend=backend,
            )
            if s == 0:
                dq = dq_blk
            else:
                dq[:, qs] += dq_blk
        # The accumulator of the block we hold arrives from the previous rank (it is ours at s=0).
        acc = dkv[s % 2]
        if dkv_transfer is not None:
            dkv_transfer.wait()
        if s == 0:  # step 0 is the full diagonal block: it initialises the accumulator
            acc[0].copy_(dk_blk)
            acc[1].copy_(dv_blk)
        elif step is not None:
            acc[0][:, step.kv] += dk_blk
            acc[1][:, step.kv] += dv_blk
        if s + 1 < world:
            dkv_transfer = comm.send_recv(acc, dkv[(s + 1) % 2], _DKV_TAG)
        else:
            # The last hop brings finished dK/dV home, after all compute, so nothing hides it. Home
            # would round them to the input dtype anyway: rounding before sending is bit-identical
            # and halves the exposed bytes for bf16/fp16. (Earlier hops carry partial sums: float32.)
            final = acc.to(k.dtype)
            home = torch.empty_like(final)
            dkv_transfer = comm.send_recv(final, home, _DKV_TAG)
        if kv_transfer is not None:
            kv_transfer.wait()
    dkv_transfer.wait()
    return dq.to(q.dtype), home[0], home[1]


class RingFlashAttnFunc(torch.autograd.Function):
    """Autograd wrapper of `ring_forward` / `ring_backward`; returns `(o, lse)`, lse not differentiable.

    Autocast is switched off inside: the merge and the accumulators are float32 by design, and
    the reference kernel's float32 einsums must not be recast to half precision.
    """

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, layout, comm, backend):
        with torch.autocast(q.device.type, enabled=False):
            o, lse = ring_forward(q, k, v, causal=causal, scale=scale, layout=layout, comm=comm, backend=backend)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.args = dict(causal=causal, scale=scale, layout=layout, comm=comm, backend=backend)
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    def backward(ctx, do, _dlse):
        q, k, v, o, lse = ctx.saved_tensors
        with torch.autocast(q.device.type, enabled=False):
            dq, dk, dv = ring_backward(do.contiguous(), q, k, v, o, lse, **ctx.args)
        return dq, dk, dv, None, None, None, None, None
