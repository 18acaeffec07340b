"""How a global sequence maps onto the ranks of a ring, and what each ring step computes.

A layout cuts the global sequence into equal chunks and gives each rank some of them, in
increasing order:
- `contiguous`: W chunks, rank r holds chunk r.
- `zigzag`: 2W chunks, rank r holds chunks r and 2W−1−r. Under causal attention every rank
  then does the same work (an early chunk that sees little, a late chunk that sees a lot).
- `stripe`: chunks of one token, token t on rank t mod W (ring-flash-attention's stripe layout,
  Striped Attention): balanced under causality at every step, not only on average.
With one rank every layout is the identity (any length is accepted).

Because each rank's chunks are in increasing global order, local position i < j implies global
position i < j, so a causal mask on local indices is exact on the diagonal block.

`ring_schedule` derives, for every ring step, which rows of the local queries attend to which
rows of the visiting key/value block and whether a causal mask applies, from the chunk ids
alone. The ring loop (ring.py) is written once against that schedule; a new layout only has to
say which chunks a rank holds. Stripe's chunks are single tokens, so its schedule is written out
(`_stripe_schedule`): every step is the whole block pair, causal with or without the diagonal.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ringflash.kernels.spec import CAUSAL, FULL, AttnSpec

LAYOUTS = ("contiguous", "zigzag", "stripe")  # append only: agree.py sends the index
# How attention reaches the other ranks' keys: K/V passed around a ring (ringflash/ring.py), or
# all-gathered in head chunks (ringflash/allgather.py). Append only, as LAYOUTS.
SCHEMES = ("ring", "allgather")

__all__ = [
    "LAYOUTS",
    "SCHEMES",
    "Step",
    "check_layout",
    "check_scheme",
    "check_splittable",
    "chunk_ids",
    "global_positions",
    "local_chunks",
    "ring_schedule",
    "shard",
    "unshard",
]


def check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def check_scheme(scheme: str) -> None:
    if scheme not in SCHEMES:
        raise ValueError(f"scheme must be one of {SCHEMES}, got {scheme!r}")


def _check_dim(x: torch.Tensor, dim: int) -> None:
    if not isinstance(dim, int) or not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim must be an int in [-{x.dim()}, {x.dim()}) for a {x.dim()}-d tensor, got {dim!r}")


def _check_rank(rank: int, world: int) -> None:
    if not isinstance(world, int) or world < 1:
        raise ValueError(f"world must be a positive int, got {world!r}")
    if not isinstance(rank, int) or not 0 <= rank < world:
        raise ValueError(f"rank must be an int in [0, world={world}), got {rank!r}")


def chunk_ids(rank: int, world: int, layout: str = "zigzag") -> tuple[int, ...]:
    """The global chunks rank `rank` holds, in increasing order (one chunk when world == 1).

    Not for `stripe`, whose chunks are single tokens: `local_chunks` counts them for any layout."""
    check_layout(layout)
    _check_rank(rank, world)
    if layout == "stripe" and world > 1:
        raise ValueError("chunk_ids: the stripe layout holds single tokens, not chunks (use global_positions)")
    if world == 1 or layout == "contiguous":
        return (rank,)
    return (rank, 2 * world - 1 - rank)


def _num_chunks(world: int, layout: str) -> int:
    return world if world == 1 or layout in ("contiguous", "stripe") else 2 * world


def local_chunks(world: int, layout: str) -> int:
    """How many equal runs of consecutive global positions a rank's shard is made of, at least
    (masks decide which steps run per run): 1 for stripe, whose rows interleave with every rank's."""
    return 1 if world == 1 or layout != "zigzag" else 2


def check_splittable(seqlen: int, world: int, layout: str = "zigzag") -> None:
    """Raise ValueError unless a global sequence of `seqlen` tokens splits evenly over `world` ranks."""
    check_layout(layout)
    _check_rank(0, world)
    if not isinstance(seqlen, int) or seqlen < 1:
        raise ValueError(f"seqlen must be a positive int, got {seqlen!r}")
    n = _num_chunks(world, layout)
    if seqlen % n:
        raise ValueError(
            f"layout={layout!r} over world={world} ranks cuts the sequence into {n} equal chunks, so "
            f"the global seqlen must be a multiple of {n}; got seqlen={seqlen} "
            f"(pad to {-(-seqlen // n) * n})"
        )


def shard(
    x: torch.Tensor, dim: int, rank: int, world: int, layout: str = "zigzag", *, head_rank: int = 0, head_world: int = 1
) -> torch.Tensor:
    """This rank's part of the global tensor `x` along `dim` (the sequence dimension).

    Returns `x` with `dim` of size `x.shape[dim] // (world · head_world)`: a view for
    `contiguous` (and for one rank), a new tensor for `zigzag`. Inputs, labels and position ids
    must be sharded alike. Head-parallel × ring (ringflash/hybrid.py): `rank`/`world` are the
    ring's, and ring shard `rank` is cut into `head_world` equal consecutive pieces, of which
    head rank `head_rank` holds piece `head_rank` (the head all-to-all puts them back together,
    in head-rank order, into ring shard `rank`).
    """
    _check_rank(rank, world)
    _check_rank(head_rank, head_world)
    _check_dim(x, dim)
    check_splittable(x.shape[dim], world, layout)
    if layout == "stripe" and world > 1:  # token t on rank t mod W; a copy, not a strided view
        out = x.unflatten(dim, (-1, world)).select(dim + 1 if dim >= 0 else dim, rank).contiguous()
        return out if head_world == 1 else _head_piece(out, dim, head_rank, head_world)
    chunks = x.chunk(_num_chunks(world, layout), dim)
    ids = chunk_ids(rank, world, layout)
    out = chunks[ids[0]] if len(ids) == 1 else torch.cat([chunks[i] for i in ids], dim)
    return out if head_world == 1 else _head_piece(out, dim, head_rank, head_world)


def _head_piece(x: torch.Tensor, dim: int, head_rank: int, head_world: int) -> torch.Tensor:
    if x.shape[dim] % head_world:
        raise ValueError(
            f"a ring shard of {x.shape[dim]} tokens does not split over head_world={head_world} "
            f"head-parallel ranks (the global seqlen must be a multiple of ring chunks × {head_world})"
        )
    return x.chunk(head_world, dim)[head_rank]


def unshard(shards: list[torch.Tensor], dim: int, layout: str = "zigzag", *, head_world: int = 1) -> torch.Tensor:
    """The global tensor from every rank's shard (`shards[r]` from rank r); inverse of `shard`.

    With `head_world` > 1, `shards[ring_rank * head_world + head_rank]` (the grid's cp order).
    """
    check_layout(layout)
    if head_world > 1:
        if len(shards) % head_world:
            raise ValueError(f"{len(shards)} shards do not form a grid with head_world={head_world}")
        shards = [torch.cat(shards[i : i + head_world], dim) for i in range(0, len(shards), head_world)]
    world = len(shards)
    if world < 1:
        raise ValueError("shards must hold one tensor per rank, got an empty list")
    for s in shards:
        _check_dim(s, dim)
    sizes = {s.shape[dim] for s in shards}
    if len(sizes) != 1:
        raise ValueError(f"every shard must have the same size along dim {dim}, got {sorted(sizes)}")
    if layout == "stripe" and world > 1:
        dim = dim % shards[0].dim()
        return torch.stack(shards, dim + 1).flatten(dim, dim + 1)
    pieces: dict[int, torch.Tensor] = {}
    for rank, s in enumerate(shards):
        ids = chunk_ids(rank, world, layout)
        if s.shape[dim] % len(ids):
            raise ValueError(
                f"shard {rank} has {s.shape[dim]} rows along dim {dim}, not divisible "
                f"into its {len(ids)} chunks under layout={layout!r}"
            )
        pieces.update(zip(ids, s.chunk(len(ids), dim)))
    return torch.cat([pieces[i] for i in range(len(pieces))], dim)


def global_positions(
    n_local: int,
    rank: int,
    world: int,
    layout: str = "zigzag",
    device: torch.device | str | None = None,
    *,
    head_rank: int = 0,
    head_world: int = 1,
) -> torch.Tensor:
    """Global position ids `(n_local,)` int64 of this rank's tokens (for RoPE and for masks).

    `head_rank`/`head_world`: this rank's place in the head-parallel group, as in `shard`.
    """
    if head_world > 1:
        _check_rank(head_rank, head_world)
        ring = global_positions(n_local * head_world, rank, world, layout, device)
        return ring[head_rank * n_local : (head_rank + 1) * n_local]
    check_splittable(n_local * world, world, layout)
    if layout == "stripe":
        return torch.arange(n_local, device=device) * world + rank
    ids = chunk_ids(rank, world, layout)
    c = n_local // len(ids)
    return torch.cat([torch.arange(i * c, (i + 1) * c, device=device) for i in ids])


@dataclass(frozen=True)
class Step:
    """One ring step's work: local query rows `q` attend to rows `kv` of the visiting block, as
    `spec` says (kernels/spec.py).

    Without documents or a window the spec is causal only on the diagonal block (the rank's own
    keys), where local order is global order; off the diagonal a chunk is wholly visible or
    wholly hidden, so the spec is full. A document/window mask gives per-row intervals instead.
    """

    q: slice
    kv: slice
    spec: AttnSpec

    def rows(self, n: int) -> tuple[int, int]:
        """(query rows, key rows) this step touches, out of n local rows each."""
        return len(range(n)[self.q]), len(range(n)[self.kv])


def _rows(chunks: list[int], ids: tuple[int, ...], c: int) -> slice:
    # Local chunk indices -> a slice of local rows; they must be adjacent to give one block.
    pos = sorted(ids.index(i) for i in chunks)
    if pos != list(range(pos[0], pos[-1] + 1)):
        raise NotImplementedError(f"visible chunks {chunks} are not adjacent in the local shard {ids}")
    return slice(pos[0] * c, (pos[-1] + 1) * c)


def ring_schedule(rank: int, world: int, n_local: int, causal: bool, layout: str = "zigzag") -> list[Step | None]:
    """What rank `rank` computes at each of the `world` ring steps (None: nothing visible).

    At step s the visiting key/value block is the one that started on rank (rank − s) mod world.
    Non-causal: every step is the full block pair. Causal: step 0 is the diagonal (full, masked);
    later steps keep only the query chunks that come after some key chunk, against the key
    chunks that some query chunk comes after. For zigzag (rank r holds chunks r and 2W − 1 − r)
    that is: kv source j < rank, all queries vs the first key chunk; j > rank, the second query
    chunk vs all keys; half a block pair at every step after the first.
    """
    check_splittable(n_local * world, world, layout)
    if layout == "stripe" and world > 1:
        return _stripe_schedule(rank, world, n_local, causal)
    mine = chunk_ids(rank, world, layout)
    c = n_local // len(mine)
    full = slice(0, n_local)
    steps: list[Step | None] = []
    for s in range(world):
        if not causal:
            steps.append(Step(full, full, FULL))
            continue
        if s == 0:
            steps.append(Step(full, full, CAUSAL))
            continue
        theirs = chunk_ids((rank - s) % world, world, layout)
        pairs = [(qi, ki) for qi in mine for ki in theirs if qi > ki]  # chunk qi sees all of ki
        if not pairs:
            steps.append(None)
            continue
        qs = sorted({qi for qi, _ in pairs})
        ks = sorted({ki for _, ki in pairs})
        if len(pairs) != len(qs) * len(ks):  # visible pairs must form one rectangle
            raise NotImplementedError(f"layout {layout!r} gives a non-rectangular step {pairs}")
        steps.append(Step(_rows(qs, mine, c), _rows(ks, theirs, c), FULL))
    return steps


def _stripe_schedule(rank: int, world: int, n_local: int, causal: bool) -> list[Step | None]:
    """Stripe: local row i of rank r is global position i·W + r. Key row m of rank j is visible
    iff m·W + j <= i·W + r, i.e. m <= i when j <= r (the causal diagonal) and m < i when j > r:
    causal shifted by one, which is the causal diagonal of queries 1.. against keys ..n−1 (row 0
    sees none of that block). Every step but that one row is a whole block pair."""
    full = slice(0, n_local)
    if not causal:
        return [Step(full, full, FULL)] * world
    steps: list[Step | None] = []
    for s in range(world):
        if (rank - s) % world <= rank:
            steps.append(Step(full, full, CAUSAL))
        else:
            steps.append(Step(slice(1, n_local), slice(0, n_local - 1), CAUSAL) if n_local > 1 else None)
    return steps
