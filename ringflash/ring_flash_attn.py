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

`stripe_*`: the stripe layout (token t on rank t mod W, stripes of one token as the peer's);
unlike the peer's they also accept `causal=False`.

`llama3_flash_attn_varlen_*`: all-gather attention (`scheme="allgather"`, ringflash/allgather.py)
on the peer's varlen arguments. The packed sequence is split contiguously (rank r holds tokens
[r·L, (r+1)·L)); `llama3_flash_attn_prepare_cu_seqlens(cu_seqlens, causal, rank, world_size)`
turns the global documents' offsets into this rank's `cu_seqlens_q`, `cu_seqlens_k`,
`max_seqlen_q`, `max_seqlen_k` and `local_k_slice` (the gathered keys its queries need); the
functions gather K/V in chunks of `heads_k_stride` heads and attend query document d to key
document d of that slice, causal aligned at the documents' ends. The mask is built on the host
per call, so these run eagerly.

Not provided: `substitute_hf_flash_attn` / `update_ring_flash_attn_params` (Hugging Face glue).
"""

from __future__ import annotations

import inspect
import itertools

import torch

from ringflash import allgather, allgather_ops, api
from ringflash.inputs import FlashArgs
from ringflash.kernels import device_guard
from ringflash.masks import varlen_mask

__all__ = [
    "llama3_flash_attn_prepare_cu_seqlens",
    "llama3_flash_attn_varlen_func",
    "llama3_flash_attn_varlen_kvpacked_func",
    "llama3_flash_attn_varlen_qkvpacked_func",
    "ring_flash_attn_func",
    "ring_flash_attn_kvpacked_func",
    "ring_flash_attn_qkvpacked_func",
    "ring_flash_attn_varlen_func",
    "ring_flash_attn_varlen_kvpacked_func",
    "ring_flash_attn_varlen_qkvpacked_func",
    "stripe_flash_attn_func",
    "stripe_flash_attn_kvpacked_func",
    "stripe_flash_attn_qkvpacked_func",
    "zigzag_ring_flash_attn_func",
    "zigzag_ring_flash_attn_kvpacked_func",
    "zigzag_ring_flash_attn_qkvpacked_func",
    "zigzag_ring_flash_attn_varlen_func",
    "zigzag_ring_flash_attn_varlen_kvpacked_func",
    "zigzag_ring_flash_attn_varlen_qkvpacked_func",
]

# The peer's names are a family's prefix, a packing and `_func`; the family fixes the form of the
# inputs and the layout, the packing the tensors.
_FAMILIES = {
    "ring_flash_attn": ("batched", "contiguous"),
    "zigzag_ring_flash_attn": ("batched", "zigzag"),
    "stripe_flash_attn": ("batched", "stripe"),
    "ring_flash_attn_varlen": ("varlen", "contiguous"),
    "zigzag_ring_flash_attn_varlen": ("varlen", "zigzag"),
    "llama3_flash_attn_varlen": ("llama3", "contiguous"),
}
_PACKINGS = {"": ("q", "k", "v"), "_kvpacked": ("q", "kv"), "_qkvpacked": ("qkv",)}
# The peer's signatures: the tensors, the form's arguments, then flash_attn's with their defaults.
_BETWEEN = {
    "batched": (),
    "varlen": ("cu_seqlens", "max_seqlen"),
    "llama3": ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "heads_k_stride", "local_k_slice"),
}
_FLASH = {
    "dropout_p": 0.0, "softmax_scale": None, "causal": False, "window_size": (-1, -1), "alibi_slopes": None,
    "deterministic": False, "return_attn_probs": False, "group": None,
}  # fmt: skip
_SHAPES = {
    "": "q `({n}, H, D)`, k, v `({n}, Hkv, D)`",
    "_kvpacked": "q `({n}, H, D)`, kv `({n}, 2, Hkv, D)`",
    "_qkvpacked": "qkv `({n}, 3, H, D)`",
}


def _drop_in(name: str):
    """The peer's function `name`, its family and packing read from the name as the tables above
    spell them, with the peer's signature, and a docstring saying what it takes and does."""
    packing = next(p for p in ("_qkvpacked", "_kvpacked", "") if name.endswith(f"{p}_func"))
    form, layout = _FAMILIES[name.removesuffix(f"{packing}_func")]
    tensors, between = _PACKINGS[packing], _BETWEEN[form]
    arg = inspect.Parameter.POSITIONAL_OR_KEYWORD
    signature = inspect.Signature(
        [inspect.Parameter(n, arg) for n in (*tensors, *between)]
        + [inspect.Parameter(n, arg, default=d) for n, d in _FLASH.items()]
    )
    attend = {"batched": _batched, "varlen": _varlen_call, "llama3": _llama3_call}[form]

    def drop_in(*args, **kwargs):
        try:
            call = signature.bind(*args, **kwargs)
        except TypeError as e:  # Python's own message for a plain function, which names it
            raise TypeError(f"{name}() {e}") from None
        call.apply_defaults()
        a = call.arguments
        return attend(tuple(a[n] for n in tensors), a, layout, *(a[n] for n in _FLASH))

    shapes = _SHAPES[packing].format(n="B, N_local" if form == "batched" else "total_local")
    how = {
        "batched": f"`ringflash.ring_flash_attn{packing}_func` with `layout='{layout}'`",
        "varlen": f"the ring, {layout} sharding of each document; lse `(H, total_local)`",
        "llama3": "all-gather attention, K/V gathered `heads_k_stride` heads at a time",
    }[form]
    drop_in.__name__ = drop_in.__qualname__ = name
    drop_in.__doc__ = f"{shapes}: {how} (module docstring)."
    drop_in.__signature__ = signature
    return drop_in


def _batched(tensors, a, layout, *flash):
    return _API[len(tensors)](*tensors, *flash, layout=layout)


def _varlen_call(tensors, a, layout, *flash):  # max_seqlen is accepted, not needed
    return _varlen(tensors, a["cu_seqlens"], layout, *flash)


def _llama3_call(tensors, a, layout, *flash):  # so are max_seqlen_q and max_seqlen_k
    return _llama3(tensors, a["cu_seqlens_q"], a["cu_seqlens_k"], a["heads_k_stride"], a["local_k_slice"], *flash)


_API = {3: api.ring_flash_attn_func, 2: api.ring_flash_attn_kvpacked_func, 1: api.ring_flash_attn_qkvpacked_func}

ring_flash_attn_func = _drop_in("ring_flash_attn_func")
ring_flash_attn_kvpacked_func = _drop_in("ring_flash_attn_kvpacked_func")
ring_flash_attn_qkvpacked_func = _drop_in("ring_flash_attn_qkvpacked_func")
zigzag_ring_flash_attn_func = _drop_in("zigzag_ring_flash_attn_func")
zigzag_ring_flash_attn_kvpacked_func = _drop_in("zigzag_ring_flash_attn_kvpacked_func")
zigzag_ring_flash_attn_qkvpacked_func = _drop_in("zigzag_ring_flash_attn_qkvpacked_func")
stripe_flash_attn_func = _drop_in("stripe_flash_attn_func")
stripe_flash_attn_kvpacked_func = _drop_in("stripe_flash_attn_kvpacked_func")
stripe_flash_attn_qkvpacked_func = _drop_in("stripe_flash_attn_qkvpacked_func")
ring_flash_attn_varlen_func = _drop_in("ring_flash_attn_varlen_func")
ring_flash_attn_varlen_kvpacked_func = _drop_in("ring_flash_attn_varlen_kvpacked_func")
ring_flash_attn_varlen_qkvpacked_func = _drop_in("ring_flash_attn_varlen_qkvpacked_func")
zigzag_ring_flash_attn_varlen_func = _drop_in("zigzag_ring_flash_attn_varlen_func")
zigzag_ring_flash_attn_varlen_kvpacked_func = _drop_in("zigzag_ring_flash_attn_varlen_kvpacked_func")
zigzag_ring_flash_attn_varlen_qkvpacked_func = _drop_in("zigzag_ring_flash_attn_varlen_qkvpacked_func")
llama3_flash_attn_varlen_func = _drop_in("llama3_flash_attn_varlen_func")
llama3_flash_attn_varlen_kvpacked_func = _drop_in("llama3_flash_attn_varlen_kvpacked_func")
llama3_flash_attn_varlen_qkvpacked_func = _drop_in("llama3_flash_attn_varlen_qkvpacked_func")


def llama3_flash_attn_prepare_cu_seqlens(cu_seqlens, causal, rank, world_size):
    """This rank's `(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, local_k_slice)` from the
    global documents' offsets `cu_seqlens` (1-d int tensor, total divisible by world_size); the
    offsets come back as tensors like cu_seqlens (module docstring)."""
    cu = _offsets(cu_seqlens, None)
    cu_q, cu_k, max_q, max_k, k_slice = allgather.prepare_cu_seqlens(cu, causal, rank, world_size)
    like = (lambda c: torch.tensor(c, dtype=cu_seqlens.dtype, device=cu_seqlens.device)) if isinstance(
        cu_seqlens, torch.Tensor) else list
    return like(cu_q), like(cu_k), max_q, max_k, k_slice


def _llama3(
    tensors, cu_seqlens_q, cu_seqlens_k, heads_k_stride, local_k_slice, dropout_p, softmax_scale, causal,
    window_size, alibi_slopes, deterministic, return_attn_probs, group,
):  # fmt: skip
    """`scheme="allgather"` on batch 1 with the documents' intervals, checked inside the call (every
    rank raises, none waits)."""

    def prepare(call, rank, world):
        q, k, v = _unpack(tensors)
        cu_q = _offsets(cu_seqlens_q, q.shape[0], "cu_seqlens_q")
        cu_k = _offsets(cu_seqlens_k, None, "cu_seqlens_k")
        n_global = q.shape[0] * world
        s = local_k_slice
        if not (isinstance(s, slice) and isinstance(s.start, int) and isinstance(s.stop, int)
                and s.step in (None, 1) and 0 <= s.start <= s.stop <= n_global):  # fmt: skip
            raise ValueError(f"local_k_slice must be a slice(start, stop) in the {n_global} gathered keys, got {s!r}")
        spec = allgather.varlen_spec(cu_q, cu_k, s, n_global, call.causal, call.window, q.device)
        return q[None], k[None], v[None], spec

    first = tensors[0]
    flash = FlashArgs(dropout_p, window_size, alibi_slopes, deterministic, return_attn_probs)
    with device_guard(first):
        options = api.CallOptions(scheme="allgather", layout="contiguous", heads_k_stride=heads_k_stride)
        o, lse = allgather_ops.attend(first, None, None, flash, softmax_scale, causal, group, options, window=None,
                                      mask=None, prepare=prepare)  # fmt: skip
    return (o[0], lse[0], None) if return_attn_probs else o[0]


def _varlen(
    tensors, cu_seqlens, layout, dropout_p, softmax_scale, causal, window_size, alibi_slopes, deterministic,
    return_attn_probs, group,
):  # fmt: skip
    """The ring on batch 1 with the documents' mask. Everything that may be refused is checked
    inside `api._attend` (through `prepare`), so that every rank raises, none waits."""

    def prepare(call, rank, world):
        q, k, v = _unpack(tensors)
        cu = _offsets(cu_seqlens, q.shape[0])
        lengths = [b - a for a, b in itertools.pairwise(cu)]
        if layout == "zigzag" and any(n % 2 for n in lengths):
            raise ValueError(
                f"cu_seqlens: zigzag gives each rank 2 equal chunks of every document, so local "
                f"document lengths must be even, got {lengths}"
            )
        mask = varlen_mask([c * world for c in cu], rank, world, layout, call, q.device)
        return q[None], k[None], v[None], mask

    first = tensors[0]
    with device_guard(first):
        flash = FlashArgs(dropout_p, window_size, alibi_slopes, deterministic, return_attn_probs)
        out = api._attend(first, None, None, flash, softmax_scale, causal, group, api.CallOptions(layout=layout),
                          prepare=prepare)  # fmt: skip
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


def _offsets(cu_seqlens, total: int | None, name: str = "cu_seqlens") -> list[int]:
    """cu_seqlens as host ints, checked against this rank's `total` tokens (None: any); errors name `name`."""
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dim() != 1 or cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype == torch.bool:
            got = f"{cu_seqlens.dtype} {tuple(cu_seqlens.shape)}"
            raise TypeError(f"{name} must be a 1-d integer tensor, got {got}")
        cu = cu_seqlens.tolist()
    elif isinstance(cu_seqlens, (list, tuple)) and all(isinstance(c, int) for c in cu_seqlens):
        cu = list(cu_seqlens)
    else:
        raise TypeError(f"{name} must be a 1-d integer tensor, got {type(cu_seqlens).__name__}")
    if len(cu) < 2 or cu[0] != 0 or cu[-1] != (cu[-1] if total is None else total) or any(
            b < a for a, b in itertools.pairwise(cu)):  # fmt: skip
        to = "" if total is None else f" to the local token count {total}"
        raise ValueError(f"{name} must rise from 0{to}, got {cu}")
    return cu
