"""Which keys each query sees: packed documents, sliding windows, any global positions.

Every mask the kernels support beyond the dense one (documents that never attend across their
boundaries, a causal sliding window, a ring step's query rows against a visiting key block)
has one shape: with positions and document ids non-decreasing along both sequences, the keys
a query row sees form one contiguous run of key rows. So a mask is given as intervals of
*local row indices of this call*:

    query row i (batch b) sees key rows j with  kv_lo[b, i] <= j < kv_hi[b, i]
    key row j   (batch b) is seen by query rows  q_lo[b, j] <= i < q_hi[b, j]

(the second is the first inverted; the dK/dV kernel, whose outer loop runs over key blocks,
needs it to bound its loop). That is a `Visibility`. The kernels test `kv_lo <= j < kv_hi` in
the blocks that straddle an interval's edge and skip the blocks outside every row's interval:
each program takes the min/max of its rows' bounds and loops over those key blocks only, so the
cost falls with the document lengths and the window instead of being computed and masked.

`visibility(q_pos, k_pos, causal=, window=, q_doc=, k_doc=)` builds one from global positions
and document ids (a ring step on a zigzag shard passes its rows' global positions), with
vectorised `searchsorted` only: no host synchronisation, so it can be built inside the ring loop
on the GPU. `varlen_visibility(cu_seqlens, total, ...)` and `dense_visibility(n, ...)` cover
packed sequences and the batch form.

Window convention: one form, flash_attn's pair `window = (left, right)`: query position p sees
key positions p − left <= t <= p + right (−1: no limit on that side), an interval by global
position like every other mask here. A causal window of w keys *counting the diagonal* (w = 1:
each token sees only itself) is `(w − 1, 0)`; an int w is accepted as that shorthand where a
window enters (`check_window`), and becomes the pair there.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

__all__ = ["Visibility", "check_visibility", "check_window", "dense_visibility", "refuse_window", "varlen_visibility",
           "visibility"]


class Visibility(NamedTuple):
    """Per-row key intervals of one kernel call (module docstring). All int32, contiguous, with a
    leading batch dim of B or 1 (shared by the batch): `kv_lo, kv_hi (B, Nq)`, `q_lo, q_hi (B, Nk)`."""

    kv_lo: torch.Tensor
    kv_hi: torch.Tensor
    q_lo: torch.Tensor
    q_hi: torch.Tensor


def check_window(
    window: int | tuple[int, int] | None, causal: bool, name: str = "window"
) -> tuple[int, int] | None:
    """`window` checked and returned in its one form, the pair `(left, right)` (module docstring), or
    None for no window. A pair's entries are ints >= -1 (-1: no limit); with causal its right is 0
    (or -1, read as 0: the diagonal bounds it anyway), and `(-1, 0)` is no window. An int w >= 1,
    causal only, is the w keys counting the diagonal, `(w - 1, 0)`. Errors name `name`."""
    if window is None:
        return None
    if isinstance(window, tuple):
        if len(window) != 2 or not all(isinstance(x, int) and not isinstance(x, bool) for x in window):
            raise TypeError(f"{name} must be a pair of ints (left, right), got {window!r}")
        left, right = window
        if min(window) < -1:
            raise ValueError(f"{name}={window}: entries must be >= 0, or -1 for no limit")
        if causal and right > 0:
            raise ValueError(
                f"{name}={window} with causal=True: a causal window has no keys to the right (right must be 0 or "
                "-1); a two-sided window needs causal=False"
            )
        if causal:
            return None if left == -1 else (left, 0)
        return None if window == (-1, -1) else window
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"{name} must be a positive int (keys seen, counting the diagonal) or None, got {window!r}")
    if not causal:
        raise ValueError(f"{name} needs causal=True (a causal sliding window: i - {name} < j <= i)")
    return (window - 1, 0)


def refuse_window(window) -> None:
    """The attention calls take flash_attn's `window_size=(left, right)`; an old `window=` is named
    with its replacement rather than read as a second form."""
    if window is not None:
        raise TypeError(
            f"window={window!r} is now window_size=(left, right), flash_attn's form (-1: no limit): a causal "
            "window of w keys is window_size=(w - 1, 0)"
        )


def _as_2d(name: str, t: torch.Tensor | None) -> torch.Tensor | None:
    if t is None:
        return None
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor, got {t.dtype}")
    if t.dim() not in (1, 2):
        raise ValueError(f"{name} must have shape (N,) or (B, N), got {tuple(t.shape)}")
    t = t.long()
    return t.unsqueeze(0) if t.dim() == 1 else t


def _check_sorted(name: str, t: torch.Tensor, strict: bool) -> None:
    # A device tensor would need a host sync to check: only CPU tensors are checked.
    if t.device.type == "cpu" and t.shape[-1] > 1:
        step = t[:, 1:] - t[:, :-1]
        if not bool((step > 0).all() if strict else (step >= 0).all()):
            order = "increasing" if strict else "non-decreasing"
            raise ValueError(f"{name} must be {order} along the sequence")


def visibility(
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    *,
    causal: bool,
    window: int | tuple[int, int] | None = None,
    q_doc: torch.Tensor | None = None,
    k_doc: torch.Tensor | None = None,
) -> Visibility:
    """The `Visibility` of query rows at global positions `q_pos` over key rows at `k_pos`.

    q_pos `(Nq,)` or `(B, Nq)`, k_pos `(Nk,)` or `(B, Nk)`: integer global positions, increasing
    along each sequence (a zigzag shard's rows are). q_doc, k_doc (optional, like the positions):
    document ids, non-decreasing along the sequence (documents are packed in order); a query sees
    only keys of its own document. causal: key position <= query position. window: w keys
    counting the diagonal (module docstring), causal only; or `(left, right)` without causal.
    Orders are checked for CPU tensors.
    """
    window = check_window(window, causal)
    if (q_doc is None) != (k_doc is None):
        raise ValueError("q_doc and k_doc must be given together (document ids of the query and key rows)")
    qp, kp, qd, kd = (_as_2d(n, t) for n, t in (("q_pos", q_pos), ("k_pos", k_pos), ("q_doc", q_doc),
                                                 ("k_doc", k_doc)))
    if qd is not None and qd.shape[-1] != qp.shape[-1]:
        raise ValueError(f"q_doc must have q_pos's length {qp.shape[-1]}, got {tuple(q_doc.shape)}")
    if kd is not None and kd.shape[-1] != kp.shape[-1]:
        raise ValueError(f"k_doc must have k_pos's length {kp.shape[-1]}, got {tuple(k_doc.shape)}")
    given = [t for t in (qp, kp, qd, kd) if t is not None]
    if len({t.device for t in given}) != 1:
        raise ValueError("q_pos, k_pos, q_doc, k_doc must be on one device")
    batches = {t.shape[0] for t in given} - {1}
    if len(batches) > 1:
        raise ValueError(f"positions and document ids must share one batch size (or 1), got {sorted(batches)}")
    B = batches.pop() if batches else 1
    qp, kp = qp.expand(B, -1).contiguous(), kp.expand(B, -1).contiguous()
    _check_sorted("q_pos", qp, strict=True)
    _check_sorted("k_pos", kp, strict=True)
    Nk = kp.shape[1]
    lo = torch.zeros_like(qp)
    hi = torch.full_like(qp, Nk)
    if qd is not None:
        qd, kd = qd.expand(B, -1).contiguous(), kd.expand(B, -1).contiguous()
        _check_sorted("q_doc", qd, strict=False)
        _check_sorted("k_doc", kd, strict=False)
        lo = torch.searchsorted(kd, qd)  # the first key of the query's document
        hi = torch.searchsorted(kd, qd, right=True)  # one past its last
    if causal:
        hi = torch.minimum(hi, torch.searchsorted(kp, qp, right=True))
    if window is not None:  # key positions [p − left, p + right], −1: unlimited
        left, right = window
        if left >= 0:
            lo = torch.maximum(lo, torch.searchsorted(kp, qp - left))
        if right >= 0:
            hi = torch.minimum(hi, torch.searchsorted(kp, qp + right, right=True))
    hi = torch.maximum(hi, lo)  # an empty row as [lo, lo): keeps both bounds non-decreasing
    # Inverse, by monotonicity: the rows that see key j are those with hi > j (a suffix) and
    # lo <= j (a prefix).
    j = torch.arange(Nk, device=qp.device).expand(B, -1).contiguous()
    q_lo = torch.searchsorted(hi, j, right=True)
    q_hi = torch.maximum(torch.searchsorted(lo, j, right=True), q_lo)
    return Visibility(*(t.to(torch.int32) for t in (lo, hi, q_lo, q_hi)))


def dense_visibility(
    n: int, *, window: int | tuple[int, int], device: torch.device | str | None = None
) -> Visibility:
    """Sliding window over one sequence of `n` tokens (the batch form's window): a pair `(left, right)`,
    query i seeing keys i − left ... i + right (a causal window is `(w − 1, 0)`); an int w is that
    causal window.

    Cached per (n, window, device): a model calls it with the same few shapes in every layer
    and step, and the tensors are never written."""
    window = check_window(window, causal=not isinstance(window, tuple))
    return _dense_visibility(n, window, torch.device(device or "cpu"))


@functools.lru_cache(maxsize=64)
def _dense_visibility(n: int, window: tuple[int, int] | None, device: torch.device) -> Visibility:
    pos = torch.arange(n, device=device)
    return visibility(pos, pos, causal=False, window=window)


def cu_seqlens_to_doc_ids(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Document id `(total,)` int64 of each packed token: token t is in document d when
    cu_seqlens[d] <= t < cu_seqlens[d + 1]."""
    check_cu_seqlens(cu_seqlens, total)
    pos = torch.arange(total, device=cu_seqlens.device)
    return torch.searchsorted(cu_seqlens[1:].contiguous().long(), pos, right=True)


def check_cu_seqlens(cu_seqlens: torch.Tensor, total: int) -> None:
    """`cu_seqlens (n_docs + 1,)` int32 (or int64): 0, then non-decreasing document ends, the last
    equal to the number of packed tokens `total`. Values are checked on CPU tensors only."""
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"cu_seqlens must be a torch.Tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"cu_seqlens must be int32 or int64, got {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must have shape (n_docs + 1,) with n_docs >= 1, got {tuple(cu_seqlens.shape)}")
    if cu_seqlens.device.type == "cpu":
        if cu_seqlens[0] != 0 or cu_seqlens[-1] != total:
            raise ValueError(
                f"cu_seqlens must start at 0 and end at the number of packed tokens ({total}), "
                f"got {cu_seqlens[0].item()} ... {cu_seqlens[-1].item()}"
            )
        if bool((cu_seqlens[1:] < cu_seqlens[:-1]).any()):
            raise ValueError("cu_seqlens must be non-decreasing")


def varlen_visibility(
    cu_seqlens: torch.Tensor, total: int, *, causal: bool, window: int | tuple[int, int] | None = None
) -> Visibility:
    """Packed documents `cu_seqlens` over `total` tokens: each token sees only its own document
    (causally if `causal`, and within `window` if given). Batch dim 1."""
    doc = cu_seqlens_to_doc_ids(cu_seqlens, total)
    pos = torch.arange(total, device=cu_seqlens.device)
    return visibility(pos, pos, causal=causal, window=window, q_doc=doc, k_doc=doc)


def check_visibility(vis: Visibility, B: int, Nq: int, Nk: int, device: torch.device) -> None:
    """Shapes, dtypes and device of a `Visibility` for a call with batch B, Nq queries, Nk keys."""
    if not isinstance(vis, tuple) or len(vis) != 4:
        raise TypeError(f"visibility must be a Visibility (kv_lo, kv_hi, q_lo, q_hi), got {type(vis).__name__}")
    for name, t, n in zip(Visibility._fields, vis, (Nq, Nq, Nk, Nk)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"visibility.{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype != torch.int32:
            raise TypeError(f"visibility.{name} must be int32, got {t.dtype}")
        if t.dim() != 2 or t.shape[0] not in (1, B) or t.shape[1] != n:
            want = f"(1, {n})" if B == 1 else f"({B} or 1, {n})"
            raise ValueError(f"visibility.{name} must have shape {want}, got {tuple(t.shape)}")
        if not t.is_contiguous():
            raise ValueError(f"visibility.{name} must be contiguous")
        if t.device != device:
            raise ValueError(f"visibility.{name} must be on q's device ({device}), got {t.device}")
    if vis.kv_lo.shape != vis.kv_hi.shape or vis.q_lo.shape != vis.q_hi.shape:
        raise ValueError("visibility.kv_lo/kv_hi (and q_lo/q_hi) must have the same shape")


def batch_stride(t: torch.Tensor) -> int:
    """Batch stride of a `(B or 1, N)` visibility tensor: 0 when shared by the whole batch."""
    return 0 if t.shape[0] == 1 else t.stride(0)
