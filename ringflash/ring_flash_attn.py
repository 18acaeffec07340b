"""ring-flash-attention's public functions, same names and argument orders, on ringflash's ring.

    from ring_flash_attn import zigzag_ring_flash_attn_func            # before
    from ringflash.ring_flash_attn import zigzag_ring_flash_attn_func  # after: nothing else changes

Each is a thin wrapper over `ringflash.ring_flash_attn_func` fixing the layout, as the peer's
names do: `ring_*` shard the sequence in `contiguous` chunks (rank r holds chunk r of W),
`zigzag_*` in `zigzag` chunks (rank r holds chunks r and 2W−1−r of 2W). Arguments as in
flash_attn: `(q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes,
deterministic, return_attn_probs, group)` on `(B, N_local, H, D)`; `return_attn_probs=True`
returns `(out, lse, None)`, lse `(B, H, N_local)` float32. What ringflash cannot do is refused by
name on every rank: `dropout_p > 0`, `alibi_slopes`, a right window with causal. `window_size`
is `(w - 1, 0)` with causal, or two-sided `(left, right)` without. Differences: `deterministic` is always honoured (the
backward has no atomics); `zigzag_*` also accept `causal=False`.

Varlen forms, on `(total_local, H, D)`, `cu_seqlens` and `max_seqlen` in the peer's convention:
each document is sharded on its own (contiguous: rank r holds chunk r of each document; zigzag:
chunks r and 2W−1−r of each), this rank's pieces are concatenated in document order, and
`cu_seqlens` / `max_seqlen` are the *local* ones (global // W, equal on every rank). lse comes
back as `(H, total_local)`. The mask is built on the host from `cu_seqlens` (a device-to-host
copy per call; cached per offsets), so these run eagerly, not under torch.compile; `max_seqlen`
is not needed and only accepted.

Not provided: `stripe_*` (ringflash has no stripe layout), `llama3_flash_attn_*` (an all-gather
of K/V with its own `heads_k_stride` / `local_k_slice` arguments, not a ring; its per-rank
`cu_seqlens` do not give the global document boundaries every rank's mask needs), and
`substitute_hf_flash_attn` / `update_ring_flash_attn_params` (Hugging Face glue).
"""

from __future__ import annotations

import itertools

import torch

from ringflash import api
from ringflash.kernels import device_guard
from ringflash.masks import varlen_mask

__all__ = [
    "ring_flash_attn_func",
    "ring_flash_attn_kvpacked_func",
    "ring_flash_attn_qkvpacked_func",
    "ring_flash_attn_varlen_func",
    "ring_flash_attn_varlen_kvpacked_func",
    "ring_flash_attn_varlen_qkvpacked_func",
    "zigzag_ring_flash_attn_func",
    "zigzag_ring_flash_attn_kvpacked_func",
    "zigzag_ring_flash_attn_qkvpacked_func",
    "zigzag_ring_flash_attn_varlen_func",
    "zigzag_ring_flash_attn_varlen_kvpacked_func",
    "zigzag_ring_flash_attn_varlen_qkvpacked_func",
]

# fmt: off
# The peer's signatures; the arguments pass through in the same order.

# ---- (B, N_local, H, D): ringflash's own functions with the layout fixed ------------------------

def ring_flash_attn_func(
        q, k, v,
        dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), alibi_slopes=None,
        deterministic=False, return_attn_probs=False, group=None,
):
    """`ringflash.ring_flash_attn_func` on the contiguous layout (module docstring)."""
    return api.ring_flash_attn_func(
        q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes, deterministic, return_attn_probs,
        group, layout="contiguous",
    )


def ring_flash_attn_kvpacked_func(
        q, kv,
        dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), alibi_slopes=None,
        deterministic=False, return_attn_probs=False, group=None,
):
    """`ringflash.ring_flash_attn_kvpacked_func` (kv `(B, N_local, 2, Hkv, D)`), contiguous layout."""
    return api.ring_flash_attn_kvpacked_func(
        q, kv, dropout_p, softmax_scale, causal, window_size, alibi_slopes, deterministic, return_attn_probs,
        group, layout="contiguous",
    )


def ring_flash_attn_qkvpacked_func(
        qkv,
        dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), alibi_slopes=None,
        deterministic=False, return_attn_probs=False, group=None,
):
    """`ringflash.ring_flash_attn_qkvpacked_func` (qkv `(B, N_local, 3, H, D)`), contiguous layout."""
    return api.ring_flash_attn_qkvpacked_func(
        qkv, dropout_p, softmax_scale, causal, window_size, alibi_slopes, deterministic, return_attn_probs,
        group, layout="contiguous",
    )


def zigzag_ring_flash_attn_func(
        q, k, v,
        dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), alibi_slopes=None,
        deterministic=False, return_attn_probs=False, group=None,
):
    """`ringflash.ring_flash_attn_func` on the zigzag layout (module docstring)."""
    return api.ring_flash_attn_func(
        q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes, deterministic, return_attn_probs,
        group, layout="zigzag",
    )


def zigzag_ring_flash_attn_kvpacked_func(
        q, kv,
        dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), alibi_slopes=None,
        deterministic=False, return_attn_probs=False, group=None,
):
    """`ringflash.ring_flash_attn_kvpacked_func` (kv `(B, N_local, 2, Hkv, D)`), zigzag layout."""
    return api.ring_flash_attn_kvpacked_func(
        q, kv, dropout_p, softmax_scale, causal, window_size, alibi_slopes, deterministic, return_attn_probs,
        group, layout="zigzag",
    )


def zigzag_ring_flash_attn_qkvpacked_func(
        qkv,
        dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), alibi_slopes=None,
        deterministic=False, return_attn_probs=False, group=None,
):
    """`ringflash.ring_flash_attn_qkvpacked_func` (qkv `(B, N_local, 3, H, D)`), zigzag layout."""
    return api.ring_flash_attn_qkvpacked_func(
        qkv, dropout_p, softmax_scale, causal, window_size, alibi_slopes, deterministic, return_attn_probs,
        group, layout="zigzag",
    )


# ---- varlen: (total_local, H, D), documents sharded one by one ---------------------------------


def ring_flash_attn_varlen_func(
        q, k, v, cu_seqlens, max_seqlen,
        dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), alibi_slopes=None,
        deterministic=False, return_attn_probs=False, group=None,
):
    """q `(total_local, H, D)`, k, v `(total_local, Hkv, D)`; contiguous per-document sharding."""
    return _varlen(
        (q, k, v), cu_seqlens, "contiguous",
        dropout_p, softmax_scale, causal, window_size, alibi_slopes, deterministic, return_attn_probs, group,
    )


def ring_flash_attn_varlen_kvpacked_func(
        q, kv, cu_seqlens, max_seqlen,
        dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), alibi_slopes=None,
        deterministic=False, return_attn_probs=False, group=None,
):
    """q `(total_local, H, D)`, kv `(total_local, 2, Hkv, D)`; contiguous per-document sharding."""
    return _varlen(
        (q, kv), cu_seqlens, "contiguous",
        dropout_p, softmax_scale, causal, window_size, alibi_slopes, deterministic, return_attn_probs, group,
    )


def ring_flash_attn_varlen_qkvpacked_func(
        qkv, cu_seqlens, max_seqlen,
        dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), alibi_slopes=None,
        deterministic=False, return_attn_probs=False, group=None,
):
    """qkv `(total_local, 3, H, D)`; contiguous per-document sharding."""
    return _varlen(
        (qkv,), cu_seqlens, "contiguous",
        dropout_p, softmax_scale, causal, window_size, alibi_slopes, deterministic, return_attn_probs, group,
    )


def zigzag_ring_flash_attn_varlen_func(
        q, k, v, cu_seqlens, max_seqlen,
        dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), alibi_slopes=None,
        deterministic=False, return_attn_probs=False, group=None,
):
    """q `(total_local, H, D)`, k, v `(total_local, Hkv, D)`; zigzag per-document sharding."""
    return _varlen(
        (q, k, v), cu_seqlens, "zigzag",
        dropout_p, softmax_scale, causal, window_size, alibi_slopes, deterministic, return_attn_probs, group,
    )


def zigzag_ring_flash_attn_varlen_kvpacked_func(
        q, kv, cu_seqlens, max_seqlen,
        dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), alibi_slopes=None,
        deterministic=False, return_attn_probs=False, group=None,
):
    """q `(total_local, H, D)`, kv `(total_local, 2, Hkv, D)`; zigzag per-document sharding."""
    return _varlen(
        (q, kv), cu_seqlens, "zigzag",
        dropout_p, softmax_scale, causal, window_size, alibi_slopes, deterministic, return_attn_probs, group,
    )


def zigzag_ring_flash_attn_varlen_qkvpacked_func(
        qkv, cu_seqlens, max_seqlen,
        dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), alibi_slopes=None,
        deterministic=False, return_attn_probs=False, group=None,
):
    """qkv `(total_local, 3, H, D)`; zigzag per-document sharding."""
    return _varlen(
        (qkv,), cu_seqlens, "zigzag",
        dropout_p, softmax_scale, causal, window_size, alibi_slopes, deterministic, return_attn_probs, group,
    )


# fmt: on


def _varlen(
    tensors, cu_seqlens, layout, dropout_p, softmax_scale, causal, window_size, alibi_slopes, deterministic,
    return_attn_probs, group,
):  # fmt: skip
    """The ring on batch 1 with the documents' mask. Everything that may be refused is checked
    inside `api._attend` (through `prepare`), so that every rank raises, none waits."""

    def prepare(window, causal, rank, world):
        q, k, v = _unpack(tensors)
        cu = _offsets(cu_seqlens, q.shape[0])
        lengths = [b - a for a, b in itertools.pairwise(cu)]
        if layout == "zigzag" and any(n % 2 for n in lengths):
            raise ValueError(
                f"cu_seqlens: zigzag gives each rank 2 equal chunks of every document, so local "
                f"document lengths must be even, got {lengths}"
            )
        mask = varlen_mask([c * world for c in cu], rank, world, layout, causal, window, q.device)
        return q[None], k[None], v[None], mask

    first = tensors[0]
    with device_guard(first):
        out = api._attend(
            first,
            None,
            None,
            dropout_p,
            softmax_scale,
            causal,
            window_size,
            alibi_slopes,
            deterministic,
            return_attn_probs,
            group,
            layout=layout,
            backend=None,
            check_ranks=True,
            window=None,
            mask=None,
            transport=None,
            prepare=prepare,
        )
    if return_attn_probs:
        o, lse, _ = out
        return o[0], lse[0], None  # lse (H, total_local), flash_attn's varlen convention
    return out[0]


def _unpack(tensors) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, k, v) as `(total, heads, D)` views of the caller's (q, k, v), (q, kv) or (qkv)."""
    names = {3: ("q", "k", "v"), 2: ("q", "kv"), 1: ("qkv",)}[len(tensors)]
    for name, t in zip(names, tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        packed = {"kv": 2, "qkv": 3}.get(name)
        want = 3 if packed is None else 4
        if t.dim() != want or (packed is not None and t.shape[1] != packed):
            shape = "(total, heads, head_dim)" if packed is None else f"(total, {packed}, heads, head_dim)"
            raise ValueError(f"{name} must have shape {shape} (varlen), got {tuple(t.shape)}")
    if len(tensors) == 1:
        return tensors[0].unbind(1)
    if len(tensors) == 2:
        return (tensors[0], *tensors[1].unbind(1))
    return tensors


def _offsets(cu_seqlens, total: int) -> list[int]:
    """cu_seqlens as host ints, checked against this rank's `total` tokens."""
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dim() != 1 or cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype == torch.bool:
            got = f"{cu_seqlens.dtype} {tuple(cu_seqlens.shape)}"
            raise TypeError(f"cu_seqlens must be a 1-d integer tensor, got {got}")
        cu = cu_seqlens.tolist()
    elif isinstance(cu_seqlens, (list, tuple)) and all(isinstance(c, int) for c in cu_seqlens):
        cu = list(cu_seqlens)
    else:
        raise TypeError(f"cu_seqlens must be a 1-d integer tensor, got {type(cu_seqlens).__name__}")
    if len(cu) < 2 or cu[0] != 0 or cu[-1] != total or any(b < a for a, b in itertools.pairwise(cu)):
        raise ValueError(f"cu_seqlens must rise from 0 to the local token count {total}, got {cu}")
    return cu
