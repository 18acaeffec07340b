"""Packed variable-length sequences, in flash_attn's `*_varlen_*` style.

Documents of any lengths are packed back to back into `(total, H, D)` tensors; `cu_seqlens`
`(n_docs + 1,)` holds their boundaries (0, end of document 0, ..., total). Each token attends
only within its own document: wholly, or causally (`causal=True`, as a language model wants;
False by default, as in flash_attn), optionally within a sliding window (`window_size`, flash_attn's).
This is `kernels.attn_fwd/attn_bwd` on a batch of one with `AttnSpec.documents` (per-row key
intervals built from the boundaries), so key blocks of other documents are skipped, not masked.

Unlike flash_attn, query and key documents are the same packing (self-attention) and the grid
spans the packed tokens, so `max_seqlen` is accepted for drop-in compatibility but not needed.
"""

from __future__ import annotations

import weakref

import torch

from ringflash import kernels
from ringflash.kernels.spec import AttnSpec

__all__ = ["attn_varlen_bwd", "attn_varlen_fwd"]


def _check_packed(**tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 3:
            raise ValueError(f"{name} must have 3 dims (total_tokens, heads, head_dim), got shape {tuple(t.shape)}")


# The documents' specs of recent calls, by the cu_seqlens tensor itself (its id, checked through a
# weak reference, and its version, which in-place writes bump): a model passes one cu_seqlens to
# every layer, forward and backward, and building the intervals is a dozen small launches each time.
_SPECS: dict[tuple, tuple[weakref.ref, AttnSpec]] = {}
_SPECS_KEPT = 16


def _documents(cu_seqlens: torch.Tensor, total: int, causal: bool, window_size, spec: AttnSpec | None,
               window=None) -> AttnSpec:
    kernels.refuse_window(window)
    if spec is not None:
        if not isinstance(spec, AttnSpec):
            raise TypeError(f"spec must be a kernels.AttnSpec or None, got {type(spec).__name__}")
        if causal or window_size not in ((-1, -1), [-1, -1]):  # the spec's own mask would win, unseen
            raise ValueError(
                f"causal={causal}, window_size={window_size!r} beside spec=: the spec already holds the "
                "documents' mask; build it with AttnSpec.documents(cu_seqlens, total, causal=, window=) and pass "
                "spec= alone"
            )
        return spec
    window = AttnSpec.from_window_size(window_size, causal=causal).window  # raises naming window_size
    if not isinstance(cu_seqlens, torch.Tensor) or torch.compiler.is_compiling():
        return AttnSpec.documents(cu_seqlens, total, causal=causal, window=window)  # raises naming it
    key = (id(cu_seqlens), cu_seqlens._version, total, causal, window)
    kept = _SPECS.get(key)
    if kept is not None and kept[0]() is cu_seqlens:
        return kept[1]
    spec = AttnSpec.documents(cu_seqlens, total, causal=causal, window=window)
    if len(_SPECS) >= _SPECS_KEPT:
        del _SPECS[next(iter(_SPECS))]
    _SPECS[key] = (weakref.ref(cu_seqlens), spec)
    return spec


def attn_varlen_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int | None = None,
    *,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softmax_scale: float | None = None,
    spec: AttnSpec | None = None,
    backend: str | None = None,
    window: None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention within packed documents.

    q `(total, H, D)`, k `(total, Hkv, D)`, v `(total, Hkv, Dv)` (H % Hkv == 0), fp16/bf16/fp32, any strides with a
    contiguous last dim; cu_seqlens `(n_docs + 1,)` int32/int64 on q's device.
    causal: within a document, token i sees j <= i (False, the default as in flash_attn: the whole
    document).
    window_size: flash_attn's `(left, right)` within a document (-1: no limit); with causal `(w − 1, 0)`
    is a sliding window of w keys counting the diagonal. `window=`, the old name, is refused naming it.
    spec: the `AttnSpec.documents(cu_seqlens, total, causal=, window=)` of an earlier call, to skip
    rebuilding it (the backward needs the same one); then without causal= or window_size=, which it holds.
    Returns `o (total, H, Dv)` in q's dtype and `lse (H, total)` float32, natural log.
    """
    del max_seqlen  # the grid spans the packed tokens
    _check_packed(q=q, k=k, v=v)
    spec = _documents(cu_seqlens, q.shape[0], causal, window_size, spec, window)
    o, lse = kernels.attn_fwd(q[None], k[None], v[None], softmax_scale=softmax_scale, spec=spec, backend=backend)
    return o[0], lse[0]


def attn_varlen_bwd(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int | None = None,
    *,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softmax_scale: float | None = None,
    spec: AttnSpec | None = None,
    backend: str | None = None,
    window: None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of `attn_varlen_fwd`: do, o `(total, H, Dv)`; lse `(H, total)` float32;
    `causal`, `window_size`, `softmax_scale` as given to the forward.

    Returns `dq`, `dk`, `dv` shaped like q, k, v, in q's dtype.
    Tokens whose lse is −inf (no visible key) get zero gradients.
    """
    del max_seqlen
    _check_packed(do=do, q=q, k=k, v=v, o=o)
    if not isinstance(lse, torch.Tensor) or lse.dim() != 2:
        raise ValueError(f"lse must have shape (heads, total_tokens), got {getattr(lse, 'shape', lse)}")
    spec = _documents(cu_seqlens, q.shape[0], causal, window_size, spec, window)
    dq, dk, dv = kernels.attn_bwd(do[None], q[None], k[None], v[None], o[None], lse[None],
                                  softmax_scale=softmax_scale, spec=spec, backend=backend)
    return dq[0], dk[0], dv[0]
