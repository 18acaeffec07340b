"""Packed documents and sliding windows across the ring: `ring_mask` and `RingMask`.

    mask = ring_mask(doc_ids, group=cp_group, causal=True, window=None, device="cuda")  # once per batch
    o = ring_flash_attn_func(q, k, v, causal=True, group=cp_group, mask=mask)           # every layer

`doc_ids` is the *global* (unsharded) `(B, N)` or `(N,)` tensor of document ids, non-decreasing
along each row; every rank holds it before sharding its batch, so building the mask needs no
communication. For this rank, the mask holds one `layout.Step` per ring step: the local query rows
and visiting key rows it touches, and the kernels' `AttnSpec` for that rectangle (per-row
intervals built by `kernels.visibility` from the rows' global positions and document ids, or the
dense causal/full spec where that is exact), or None when the step is skipped because no
(query, key) pair in it is visible.

Which steps run, and on which rows, is computed here exactly, on the host, from the
`Visibility` of the whole local block pair: a step's rectangle is the bounding box of the layout
chunks holding a query row that sees some key and a key row that some query sees (the union
over the batch), so a step is skipped iff no pair in it is visible. (Zigzag steps after the
first are 1×2 or 2×1 chunk pairs under causality, so that box is exactly what remains.)
Inside the rectangle the kernels skip the tiles no row sees, so compute falls with the
document lengths and the window. Step 0 (this rank's own keys, the diagonal) always runs on
every row: it initialises the accumulators.

Cost model, per layer and per direction, on W ranks with N local tokens:
- Communication does not fall with the mask: every rank still sends and receives W − 1 K/V
  blocks (the forward) and W − 1 K/V blocks plus W dK/dV blocks (the backward), because every
  rank must do the same number of transfers in the same order, and the ring keeps them in
  lock step. A skipped step costs its transfer (hidden behind the previous step's compute when
  there is one) and nothing else: no kernel launch, no merge.
- Compute falls with what is visible: about (visible pairs / N²) of a dense step, at tile
  granularity. A sliding window w on the zigzag layout leaves, per rank, the diagonal plus the
  steps whose key chunks lie within w of its query chunks: for w ≤ N/2 (one chunk) only the
  chunks adjacent in the global order, i.e. at most 2 off-diagonal steps of the W − 1.
- So once the visible work of the remaining steps is smaller than a K/V transfer, the ring is
  bound by communication: time ≈ (W − 1) · transfer, whatever the window. (A halo exchange of
  only the w keys a rank needs would be cheaper for small windows; not done here.)

Without documents and without a window (or with a window of the whole sequence) the mask is
the plain causal schedule: no intervals, the kernels' dense causal path.

Two-sided windows (`window=(left, right)`, flash_attn's `window_size` with causal=False, for
encoders) are per-row key intervals by global position like the causal ones, so the same
plan applies: steps whose chunks lie farther apart than the window are skipped.

torch.compile: build the mask outside the compiled region and pass it in (`forward(...,
mask=mask)`). Its Visibility tensors are graph inputs; its plan (which steps run, on which
chunks) is a set of ints that Dynamo guards on, so a batch whose plan differs from every plan
seen so far compiles again (bounded: each step has only a few chunk-pair variants, but raise
`torch._dynamo.config.cache_size_limit` for many ranks). `window=` without a mask builds the
mask inside the call: use it eagerly, or pass `mask=ring_mask(None, seqlen=..., window=...)`.

`varlen_mask`: the same for documents sharded one by one (ring-flash-attention's varlen
convention, ringflash/ring_flash_attn.py), from their offsets.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ringflash.kernels import CAUSAL, FULL, AttnSpec, Visibility, visibility
from ringflash.layout import (
    LAYOUTS,
    Step,
    check_layout,
    check_splittable,
    global_positions,
    local_chunks,
    ring_schedule,
    shard,
)

__all__ = ["RingMask", "decode", "op_args", "ring_mask", "varlen_mask", "window_mask"]


@dataclass(frozen=True, eq=False)
class RingMask:
    """What rank `rank` of `world` computes at each ring step under a document/window mask.

    Attributes: `steps` (`world` entries, a `layout.Step` or None where the step is skipped),
    `spec` (the `AttnSpec` of the whole sequence before documents: causal and window; read as
    `causal`, `window`), `layout`, `rank`, `world`,
    `n_local` (local tokens), `batch` (the mask's batch size; 1 = shared by every row),
    `n_docs` (documents in the whole batch), `fingerprint` (an int64 hash of everything that
    must agree between ranks: checked across ranks by the op), `device`.
    """

    steps: tuple[Step | None, ...]
    spec: AttnSpec
    layout: str
    rank: int
    world: int
    n_local: int
    batch: int
    n_docs: int
    fingerprint: int
    device: torch.device
    plan: tuple[int, ...] = ()  # `op_args`, precomputed: plain attribute reads under torch.compile
    tensors: tuple[torch.Tensor, ...] = ()

    def __post_init__(self):
        ints, tensors = _encode(self.steps)
        object.__setattr__(self, "plan", tuple(ints))
        object.__setattr__(self, "tensors", tuple(tensors))
        _LIVE[_op_key(self.plan, self.tensors)] = self

    @property
    def causal(self) -> bool:
        return self.spec.causal

    @property
    def window(self) -> tuple[int, int] | None:
        return self.spec.window

    @property
    def skipped(self) -> tuple[int, ...]:
        """The steps that launch no kernel (their K/V still travel around the ring)."""
        return tuple(s for s, st in enumerate(self.steps) if st is None)

    def __repr__(self) -> str:
        return (
            f"RingMask(rank={self.rank}, world={self.world}, layout={self.layout!r}, causal={self.causal}, "
            f"window={self.window}, n_local={self.n_local}, batch={self.batch}, n_docs={self.n_docs}, "
            f"skipped={self.skipped})"
        )


def op_args(mask: RingMask | None) -> tuple[list[torch.Tensor], dict]:
    """A mask (or None) as the ring op's arguments (ringflash/ops.py): its Visibility tensors, 4
    per step of kind 2 in step order, and the keywords `mask_plan` (host metadata, 5 ints per
    step `[q_start, q_stop, kv_start, kv_stop, kind]`: kind −1 skipped, 0 dense, 1 causal,
    2 visibility; None without a mask), `mask_key` (the fingerprint) and `window_size` (the
    window in flash_attn's form), the last two for the cross-rank check. `decode` inverts it."""
    if mask is None:
        return [], dict(mask_plan=None, mask_key=0, window_size=[-1, -1])
    return list(mask.tensors), dict(
        mask_plan=list(mask.plan), mask_key=mask.fingerprint, window_size=list(mask.spec.window_size)
    )


def _encode(steps) -> tuple[list[int], list[torch.Tensor]]:
    ints: list[int] = []
    tensors: list[torch.Tensor] = []
    for step in steps:
        if step is None:
            ints += [0, 0, 0, 0, -1]
            continue
        spec = step.spec
        if spec.window is not None:
            raise ValueError("a ring step's window travels as intervals: build the step with AttnSpec(intervals=...)")
        kind = 2 if spec.intervals is not None else int(spec.causal)
        ints += [step.q.start, step.q.stop, step.kv.start, step.kv.stop, kind]
        if spec.intervals is not None:
            tensors += list(spec.intervals)
    return ints, tensors


# Every live RingMask by its op arguments, so that `decode` hands the ops (which see only ints
# and tensors) the mask's own steps instead of rebuilding them on every call, forward and
# backward. Weak: an entry goes with its mask, and while the mask lives so do its tensors, so no
# other tensor can have their ids.
_LIVE: weakref.WeakValueDictionary[tuple, RingMask] = weakref.WeakValueDictionary()


def _op_key(ints, tensors) -> tuple:
    return tuple(ints), tuple(map(id, tensors))


def decode(ints: list[int], tensors: list[torch.Tensor]) -> list[Step | None]:
    """Inverse of `op_args`: the steps ring.py loops over, from `mask_plan` and the tensors (a live
    mask's own steps when they are its arguments)."""
    mask = _LIVE.get(_op_key(ints, tensors))
    if mask is not None:
        return list(mask.steps)
    if len(ints) % 5:
        raise ValueError(f"mask plan must hold 5 ints per step, got {len(ints)}")
    out: list[Step | None] = []
    t = 0
    for i in range(0, len(ints), 5):
        q0, q1, k0, k1, kind = ints[i : i + 5]
        if kind < 0:
            out.append(None)
            continue
        if kind == 2:
            spec = AttnSpec(intervals=Visibility(*tensors[t : t + 4]))
            t += 4
        else:
            spec = CAUSAL if kind == 1 else FULL
        out.append(Step(slice(q0, q1), slice(k0, k1), spec))
    if t != len(tensors):
        raise ValueError(f"mask tensors: expected {t} for the plan, got {len(tensors)}")
    return out


def _group_rank_world(group) -> tuple[int, int]:
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a torch.distributed ProcessGroup or None, got {type(group).__name__}")
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("group: this process is not a member of the given process group")
    return rank, dist.get_world_size(group)


def _check_doc_ids(doc_ids) -> torch.Tensor:
    if not isinstance(doc_ids, torch.Tensor):
        raise TypeError(f"doc_ids must be a torch.Tensor or None, got {type(doc_ids).__name__}")
    if doc_ids.dtype.is_floating_point or doc_ids.dtype.is_complex or doc_ids.dtype == torch.bool:
        raise TypeError(f"doc_ids must be an integer tensor, got {doc_ids.dtype}")
    if doc_ids.dim() not in (1, 2) or doc_ids.shape[-1] < 1:
        raise ValueError(f"doc_ids must have shape (N_global,) or (B, N_global), got {tuple(doc_ids.shape)}")
    d = doc_ids.detach().to("cpu", torch.int64)  # one copy per batch: the host work happens here
    d = d.unsqueeze(0) if d.dim() == 1 else d
    if d.shape[1] > 1 and bool((d[:, 1:] < d[:, :-1]).any()):
        row = int((d[:, 1:] < d[:, :-1]).any(1).nonzero()[0])
        raise ValueError(f"doc_ids must be non-decreasing along each row (documents packed in order); row {row} is not")
    return d


def _fingerprint(
    causal, window, layout, world, n_global, doc: torch.Tensor | None, per_document: bool = False
) -> tuple[int, int]:
    """(number of documents, an int64 hash of the mask's global definition): equal on every rank
    given the same arguments. Documents enter as their boundaries (run lengths) per row."""
    h = hashlib.blake2b(digest_size=8)
    h.update(repr((causal, window, layout, world, n_global) + (("per_document",) if per_document else ())).encode())
    n_docs = 1
    if doc is not None:
        change = torch.ones_like(doc, dtype=torch.bool)
        change[:, 1:] = doc[:, 1:] != doc[:, :-1]
        n_docs = int(change.sum())
        starts = change.nonzero()  # (row, position) of every document start: cu_seqlens per row
        h.update(repr(tuple(doc.shape)).encode())
        h.update(starts.numpy().tobytes())
    return n_docs, int.from_bytes(h.digest(), "little", signed=True)


def _bounds(seen: torch.Tensor, n_chunks: int) -> slice | None:
    """The rows of the local chunks (n_chunks of them) that hold a True of `seen (n_local,)`, as
    one slice (a shard's chunks are adjacent), or None if none does. Whole chunks, not rows, so
    that a plan changes only when a chunk pair's visibility does, not with every document
    boundary (under torch.compile a new plan is a recompilation)."""
    c = seen.shape[0] // n_chunks
    idx = seen.view(n_chunks, c).any(1).nonzero()
    return None if idx.numel() == 0 else slice(int(idx[0]) * c, (int(idx[-1]) + 1) * c)


def _dense(vis: Visibility, causal_diag: bool) -> bool:
    # The rectangle's mask is exactly the dense one (all keys, or causal on a square diagonal).
    nk = vis.q_lo.shape[1]
    hi = torch.arange(1, vis.kv_hi.shape[1] + 1) if causal_diag else torch.full((vis.kv_hi.shape[1],), nk)
    if causal_diag and vis.kv_hi.shape[1] != nk:
        return False
    return bool((vis.kv_lo == 0).all()) and bool((vis.kv_hi == hi.to(vis.kv_hi.dtype)).all())


def _same(a: Visibility, b: Visibility) -> bool:
    """The same key intervals for every row (batch rows of b, broadcast)."""
    return all(torch.equal(x, y.expand_as(x)) for x, y in zip(a, b))


def ring_mask(
    doc_ids: torch.Tensor | None,
    *,
    seqlen: int | None = None,
    group: dist.ProcessGroup | None = None,
    layout: str = "zigzag",
    causal: bool = True,
    window: int | tuple[int, int] | None = None,
    device: torch.device | str | None = None,
) -> RingMask:
    """Build this rank's `RingMask` (module docstring) for one batch; reuse it in every layer.

    Args:
        doc_ids: global `(B, N_global)` or `(N_global,)` integer document ids, non-decreasing
            along each row (any CPU or device tensor; it is read on the host once). None: one
            document, then `seqlen` gives N_global.
        seqlen: N_global when doc_ids is None (if both are given they must agree).
        group: the context-parallel group (None: the default group, or this process alone).
        layout: how the inputs are sharded (`"zigzag"`, `"contiguous"` or `"stripe"`); N_global
            must split.
        causal: key position <= query position (global order).
        window: a pair `(left, right)`, flash_attn's `window_size`: query i sees i − left <= j <= i + right
            (-1: no limit), with causal `(w − 1, 0)`: w keys counting the diagonal, which an int w also
            means. `mask.window` is the pair.
        device: where the `Visibility` tensors live: q's device. Default: doc_ids' device (CPU
            when doc_ids is None).
    """
    check_layout(layout)
    spec = AttnSpec(causal=causal, window=window)
    rank, world = _group_rank_world(group)
    doc = None if doc_ids is None else _check_doc_ids(doc_ids)
    if doc is None:
        if seqlen is None:
            raise ValueError("seqlen: give N_global when doc_ids is None (one document)")
        n_global = seqlen
    else:
        n_global = doc.shape[1]
        if seqlen is not None and seqlen != n_global:
            raise ValueError(f"seqlen={seqlen} disagrees with doc_ids.shape[-1] = {n_global}")
    check_splittable(n_global, world, layout)
    if device is None and doc_ids is not None:
        device = doc_ids.device
    device = _device(device)
    return _build(doc, n_global, rank, world, layout, spec, device)


def _device(device) -> torch.device:
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())  # compare equal to q.device
    return device


def _build(doc, n_global, rank, world, layout, spec: AttnSpec, device, per_document=False) -> RingMask:
    """`per_document`: each document (of doc's one row) is cut by the layout on its own, and a
    rank holds its pieces of every document in order (`varlen_mask`); else the whole row is."""
    causal, window = spec.causal, spec.window
    n_local = n_global // world
    # A window of the whole sequence sees the whole causal past (or all keys): no window.
    window_eff = None if window is None or _covers(window, n_global, causal) else window
    n_docs, fp = _fingerprint(causal, window, layout, world, n_global, doc, per_document)
    if per_document:  # a rank's rows are whole-block granular: its pieces of many documents
        rows, n_chunks = functools.partial(_document_rows, doc[0], world, layout), (lambda j: 1)
    else:
        rows = functools.partial(_layout_rows, doc, n_local, world, layout)
        n_chunks = lambda j: local_chunks(world, layout)
    steps: list[Step | None] = []
    if doc is None and window_eff is None:
        steps = ring_schedule(rank, world, n_local, causal, layout)
    else:
        pos_r, doc_r = rows(rank)
        full = slice(0, n_local)
        for s in range(world):
            j = (rank - s) % world
            pos_j, doc_j = rows(j)
            kw = dict(causal=causal, window=window_eff)

            def vis_of(qs, ks, kw=kw, pos_j=pos_j, doc_j=doc_j):
                return visibility(pos_r[qs], pos_j[ks], **kw,
                                  q_doc=None if doc_r is None else doc_r[:, qs],
                                  k_doc=None if doc_j is None else doc_j[:, ks])  # fmt: skip

            whole = vis_of(full, full)
            if s == 0:
                qs = ks = full  # the diagonal always runs on every row: it starts the accumulators
            else:
                qs = _bounds((whole.kv_hi > whole.kv_lo).any(0), n_chunks(rank))
                ks = _bounds((whole.q_hi > whole.q_lo).any(0), n_chunks(j))
                if qs is None:
                    steps.append(None)
                    continue
            if layout == "stripe" and causal and s > 0:
                # Stripe's off-diagonal steps are shifted diagonals: the dense causal kernel when
                # the mask leaves the plain schedule's step as it is (one document, no window).
                plain = ring_schedule(rank, world, n_local, True, layout)[s]
                if plain is not None and _same(whole, visibility(pos_r, pos_j, causal=True)):
                    steps.append(plain)
                    continue
            vis = whole if (qs, ks) == (full, full) else vis_of(qs, ks)
            diag = s == 0 and causal
            if _dense(vis, diag):
                steps.append(Step(qs, ks, CAUSAL if diag else FULL))
            else:
                steps.append(Step(qs, ks, AttnSpec(intervals=Visibility(*(t.to(device) for t in vis)))))
    return RingMask(
        steps=tuple(steps), spec=spec, layout=layout, rank=rank, world=world, n_local=n_local,
        batch=1 if doc is None else doc.shape[0], n_docs=n_docs, fingerprint=fp, device=device,
    )  # fmt: skip


def _covers(window: tuple[int, int] | None, n_global: int, causal: bool) -> bool:
    """The window lets every row see all it would see without one (causal: its right side is the
    diagonal's)."""
    sides = window[:1] if causal else window
    return all(x == -1 or x >= n_global - 1 for x in sides)


def window_mask(n_local: int, spec: AttnSpec, rank: int, world: int, layout: str, device: torch.device) -> RingMask:
    """The window-only mask of a call given a window and no mask (`spec`: its causal flag and
    window), cached per arguments (a model calls it with the same few shapes in every layer and
    step)."""
    return _window_mask(n_local, spec, rank, world, layout, _device(device))


@functools.lru_cache(maxsize=64)
def _window_mask(n_local, spec, rank, world, layout, device) -> RingMask:
    if layout not in LAYOUTS:
        check_layout(layout)
    return _build(None, n_local * world, rank, world, layout, spec, device)


def _layout_rows(doc, n_local, world, layout, j) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rank j's global positions `(n_local,)` and document ids `(B, n_local)` (or None)."""
    return global_positions(n_local, j, world, layout), None if doc is None else shard(doc, 1, j, world, layout)


def _document_rows(doc, world, layout, j) -> tuple[torch.Tensor, torch.Tensor]:
    """The same for per-document sharding: rank j's piece of each document in turn. Positions
    still increase and ids never decrease along the rank's rows, so per-row key intervals
    (kernels.visibility) describe its mask exactly."""
    starts = torch.cat([torch.zeros(1, dtype=torch.long), (doc[1:] != doc[:-1]).nonzero()[:, 0] + 1])
    lengths = torch.diff(starts, append=torch.tensor([doc.shape[0]]))
    pos = [int(g) + global_positions(int(n) // world, j, world, layout) for g, n in zip(starts, lengths)]
    ids = [doc[g : g + int(n) // world] for g, n in zip(starts, lengths)]  # one id per document: any of its rows
    return torch.cat(pos), torch.cat(ids).unsqueeze(0)


def varlen_mask(cu_seqlens: tuple[int, ...], rank: int, world: int, layout: str, spec: AttnSpec, device) -> RingMask:
    """The mask of ring-flash-attention's varlen sharding (ringflash/ring_flash_attn.py): the
    documents `cu_seqlens` (global offsets, starting at 0) are each cut by `layout` on their own,
    and every rank holds its pieces of all of them, in document order; `spec`: the call's causal
    flag and window. Cached per arguments: the varlen functions call it in every layer. Raises
    ValueError naming cu_seqlens."""
    return _varlen_mask(tuple(cu_seqlens), rank, world, layout, spec, _device(device))


@functools.lru_cache(maxsize=64)
def _varlen_mask(cu, rank, world, layout, spec, device) -> RingMask:
    check_layout(layout)
    lengths = [b - a for a, b in itertools.pairwise(cu)]
    if len(cu) < 2 or cu[0] != 0 or min(lengths) < 0:
        raise ValueError(f"cu_seqlens must start at 0 and never decrease, got {list(cu)}")
    chunks = local_chunks(world, layout) * world
    if any(n % chunks for n in lengths) or cu[-1] == 0:
        raise ValueError(
            f"cu_seqlens: with {world} ranks and the {layout} layout every document must have a multiple of "
            f"{chunks} tokens (each is cut into {chunks} chunks), got document lengths {lengths}"
        )
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)).unsqueeze(0)
    return _build(doc, cu[-1], rank, world, layout, spec, device, per_document=True)
