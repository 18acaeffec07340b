"""The cross-rank agreement check every path starts with: ring, hybrid, one rank, `shard_batch`.

Each rank all-gathers one fixed-length int64 row (`row`) describing its call: which call (ring
attention, hybrid attention, shard_batch) over how many ranks and by which scheme (ring, all-
gather), q/k shapes and v's head dim, dtype, device, layout, causal, softmax_scale (its exact bits),
the window (as flash_attn's window_size), softcap (exact bits), the learnable sink's presence and
shape, the mask's digest, transport, and for a batch its shape and a digest of each field. Not the
kernel backend: ranks on different kernels compute the same attention, to rounding, with the same
transfers. Every rank then compares every row and raises the same ValueError, naming the field and
each global rank's value. Because the row has the same length whatever the call, ranks that disagree
even on *which* call they make (one omits `head_group=`; one's model never entered the ring) meet in
the same collective and all raise, instead of one dying inside gloo on a size mismatch and the
others hanging.

A rank that rejects its own inputs sends a row with `ok = 0` (`announce`), so the others raise
too. The collective runs over the whole context-parallel group: for groups made by
`ringflash.hybrid_groups` (or registered with `register_grid`) that is the whole grid, whichever
of its groups the call was given (`transport.groups.grid_of`); otherwise the call's own group.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

import torch
import torch.distributed as dist

from ringflash.kernels.checks import SUPPORTED_DTYPES
from ringflash.layout import LAYOUTS, SCHEMES
from ringflash.transport import TRANSPORTS, Transport, ring_comm
from ringflash.transport.groups import grid_of

__all__ = ["BATCH_FIELDS", "CALLS", "WIDTH", "announce", "check", "check_comm", "compare", "digest", "row"]

CALLS = ("ring attention", "hybrid attention", "shard_batch")
BATCH_FIELDS = ("input_ids", "labels", "position_ids", "attention_mask")
_DEVICES = ("cpu", "cuda")

# (field, width): the row after its leading ok flag. Unused fields hold -1 (or 0 for digests).
_FIELDS = (
    ("call", 3), ("scheme", 1), ("q.shape", 4), ("k.shape", 4), ("v.shape[3]", 1), ("dtype", 1), ("device", 1),
    ("layout", 1), ("causal", 1), ("softmax_scale", 1), ("window_size", 2), ("softcap", 1), ("learnable_sink", 1),
    ("mask", 1), ("transport", 1), ("input_ids shape", 2),
    *((name, 1) for name in BATCH_FIELDS),
)  # fmt: skip
WIDTH = 1 + sum(w for _, w in _FIELDS)


def _index(table: Sequence, value) -> int:
    return table.index(value) if value in table else -1


def _shape(t, n: int) -> list[int]:
    return list(t.shape) if isinstance(t, torch.Tensor) and t.dim() == n else [-1] * n


def digest(t: torch.Tensor | None) -> int:
    """A 63-bit digest of `t`'s shape, dtype and values (0: None): equal tensors give equal digests."""
    if t is None:
        return 0
    t = t.detach().to("cpu").contiguous()
    h = hashlib.blake2b(f"{tuple(t.shape)} {t.dtype}".encode(), digest_size=8)
    h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return int.from_bytes(h.digest(), "little") >> 1 or 1


def row(
    ok: bool,
    call: str,
    world: int,
    heads: int = 1,
    *,
    q=None,
    k=None,
    v=None,
    causal=None,
    softmax_scale=None,
    layout=None,
    mask_key: int = 0,
    transport=None,
    batch: dict | None = None,
    scheme: str = "ring",
    window_size=(-1, -1),
    softcap=0.0,
    learnable_sink=None,
) -> list[int]:
    """This rank's row: `call` (one of `CALLS`) over `world` ranks (`heads`: the hybrid's u), and
    the call's settings; `batch`: shard_batch's fields (BATCH_FIELDS), each `(B, N)` or None;
    `scheme`: how attention reaches the other ranks' keys (`layout.SCHEMES`). `learnable_sink` is
    compared by presence and shape, not values (a parameter each rank holds)."""
    dtype, device = getattr(q, "dtype", None), getattr(q, "device", None)
    scale = float(softmax_scale) if _real(softmax_scale) else -1
    ids = (batch or {}).get("input_ids")
    return [
        int(ok),
        CALLS.index(call), world, heads,
        _index(SCHEMES, scheme),
        *_shape(q, 4), *_shape(k, 4), _shape(v, 4)[3],
        _index(SUPPORTED_DTYPES, dtype),
        _index(_DEVICES, getattr(device, "type", None)) if device is not None else -1,
        _index(LAYOUTS, layout),
        -1 if causal is None else int(bool(causal)),
        _bits(scale) if scale != -1 else -1,
        *_pair(window_size),
        _bits(softcap) if _real(softcap) else -1,
        learnable_sink.numel() if isinstance(learnable_sink, torch.Tensor) and learnable_sink.dim() == 1 else (
            -1 if learnable_sink is None else -2),
        mask_key,
        _index(TRANSPORTS, transport),
        *_shape(ids, 2),
        *(digest((batch or {}).get(name)) if batch is not None else 0 for name in BATCH_FIELDS),
    ]  # fmt: skip


def _real(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _bits(x: float) -> int:
    """A float's exact bits as an int64: ranks agree only on the very same value."""
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def _pair(ws) -> list[int]:
    ok = isinstance(ws, (tuple, list)) and len(ws) == 2 and all(isinstance(x, int) for x in ws)
    return [int(x) for x in ws] if ok else [-2, -2]


def _show(name: str, v: tuple[int, ...]):
    """A field's value as a person reads it: names for dtypes, layouts, booleans; None for unset."""
    x = v[0]
    if name == "call":
        call, world, heads = CALLS[x], v[1], v[2]
        if call == "hybrid attention":
            return f"hybrid attention (u = {heads} head × r = {world} ring ranks)"
        return f"{call} over {world} rank(s)"
    if name.endswith("shape"):
        return None if v[0] == -1 else v
    if name == "window_size":
        return v
    if name == "v.shape[3]":
        return None if x == -1 else x
    if name == "learnable_sink":
        return {-1: None, -2: "not a (H,) tensor"}.get(x, f"({x},)")
    if x == -1 and name != "mask":
        return None
    if name == "dtype":
        return str(SUPPORTED_DTYPES[x])
    if name == "device":
        return _DEVICES[x]
    if name == "layout":
        return LAYOUTS[x]
    if name == "scheme":
        return SCHEMES[x]
    if name == "causal":
        return bool(x)
    if name in ("softmax_scale", "softcap"):
        return struct.unpack("<d", struct.pack("<q", x))[0]
    if name == "transport":
        return TRANSPORTS[x]
    return "none" if x == 0 else f"{x & (2**64 - 1):016x}"  # a digest


_LABELS = {"mask": "the mask (documents, window or layout given to ring_mask)"}
_LABELS.update({name: f"batch[{name!r}] (digest)" for name in BATCH_FIELDS})


def _rank_list(ranks: list[int]) -> str:
    """`rank 3`, or `ranks 0-2, 5`: global ranks, runs shortened."""
    runs: list[list[int]] = []
    for g in ranks:
        if runs and g == runs[-1][-1] + 1:
            runs[-1].append(g)
        else:
            runs.append([g])
    text = ", ".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)
    return f"rank {text}" if len(ranks) == 1 else f"ranks {text}"


def compare(rows: list[list[int]], ranks: list[int], what: str) -> None:
    """Raise ValueError if any row rejected its inputs or differs from the others; `ranks`: each
    row's global rank; `what`: this rank's call, for the message."""
    failed = [g for g, r in zip(ranks, rows) if r[0] == 0]
    if failed:
        raise ValueError(
            f"{what}: rank(s) {failed} of the group rejected their inputs (see the error raised there); every "
            "rank raises so that none waits for them"
        )
    i = 1
    for name, width in _FIELDS:
        vals = [tuple(r[i : i + width]) for r in rows]
        if len(set(vals)) > 1:
            hint = ""
            if name == "call":
                hint = (
                    " (ranks of one context-parallel group must make the same call together: a rank in another "
                    "call did not enter this one, e.g. its model does not use ring attention, or it was not given "
                    "head_group=)"
                )
            by_value: dict[tuple, list[int]] = {}
            for g, v in zip(ranks, vals):
                by_value.setdefault(v, []).append(g)
            raise ValueError(
                f"{what} inputs differ between the ranks of the group: {_LABELS.get(name, name)} is "
                + ", ".join(f"{_show(name, v)} on {_rank_list(gs)}" for v, gs in by_value.items())
                + hint
            )
        i += width


def check_comm(group: dist.ProcessGroup | None) -> Transport:
    """The transport the check gathers over for a call on `group`: its grid's, else its own."""
    return ring_comm(grid_of(group) or group, "nccl")


def _global_ranks(comm: Transport) -> list[int]:
    if comm.group is None:
        return list(range(comm.world))
    return dist.get_process_group_ranks(comm.group)  # in group-rank order, the default group's too


def check(comms: Transport | Sequence[Transport], mine: list[int]) -> None:
    """Gather `mine` over each of `comms` in turn (one comm: one collective) and `compare`.

    With several comms (groups that together reach every rank, e.g. a head group then a ring
    group), a rank that failed an earlier stage sends `ok = 0` to the later ones, so the
    verdict reaches them all; it raises after its last gather.
    """
    comms = [comms] if not isinstance(comms, Sequence) else list(comms)
    what = CALLS[mine[1]]
    verdict = None
    for comm in comms:
        if comm.world == 1:
            continue
        sent = mine if verdict is None else [0, *mine[1:]]
        rows = comm.all_gather_ints(sent)
        if verdict is None:
            try:
                compare(rows, _global_ranks(comm), what)
            except ValueError as e:
                verdict = e
    if verdict is not None:
        raise verdict


def announce(comms: Transport | Sequence[Transport], call: str, world: int, heads: int = 1, **fields) -> None:
    """This rank rejected its inputs: send `ok = 0` into the check the other ranks wait in."""
    comms = [comms] if not isinstance(comms, Sequence) else list(comms)
    mine = row(False, call, world, heads, **fields)
    for comm in comms:
        if comm.world > 1:
            comm.all_gather_ints(mine)
