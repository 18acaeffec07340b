"""Ranks that disagree raise on every rank, in bounded time, over gloo (ringflash/agree.py).

Each case runs a 2 × 2 or 4 × 1 grid (`hybrid_groups`) where the last rank's call differs. Every
rank records what it raised and how long it took, then waits for the others in a barrier on a
group of its own: a rank that raised stays alive, so a rank left waiting cannot be released by a
closed connection, only by an answer, and one that hangs shows up as a timeout of the grid's
groups (`run_ranks`' timeout, which `hybrid_groups` now passes on) instead of a ValueError.
"""

from __future__ import annotations

import datetime
import time

import pytest
import torch
import torch.distributed as dist

from ringflash import grid_coords, hybrid_groups, ring_flash_attn_func, ring_mask, shard
from tests.dist_utils import run_ranks

TIMEOUT_S = 20  # the groups' timeout: a rank still waiting after it fails with RuntimeError, not ValueError
B, N, H, D = 1, 16, 4, 8


def _call(rank, world, u, what):
    alive = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=3 * TIMEOUT_S))
    ring_g, head_g = hybrid_groups(u)
    r = world // u
    ring_rank, head_rank = grid_coords(rank, u)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, N, H, D, generator=g) for _ in range(3))
    ql, kl, vl = (shard(t, 1, ring_rank, r, "zigzag", head_rank=head_rank, head_world=u) for t in (q, k, v))
    kw = dict(causal=True, group=ring_g, head_group=head_g, backend="reference")
    odd = rank == world - 1
    if what == "window" and odd:
        kw["window_size"] = (4, 0)
    elif what == "scale" and odd:
        kw["softmax_scale"] = 0.3
    elif what == "mask":
        doc = torch.zeros(1, N, dtype=torch.long)
        doc[:, 9 if odd else 6 :] = 1  # two documents, cut elsewhere on one rank
        kw["mask"] = ring_mask(doc, group=ring_g, causal=True)
    elif what == "no_head_group" and odd:
        del kw["head_group"]
    elif what == "bad_q" and odd:
        ql = ql[0]  # 3 dims: refused by this rank, announced to the others
    elif what == "bad_window_size" and odd:  # refused before the all-to-all, not inside the ring after it
        kw["window_size"] = (3, 1)
    start = time.monotonic()
    try:
        ring_flash_attn_func(ql, kl, vl, **kw)
        got = ("no error", "")
    except Exception as e:  # a timeout (RuntimeError) must be reported, not raised
        got = (type(e).__name__, str(e))
    took = time.monotonic() - start
    dist.barrier(group=alive)  # stay alive until every rank has its answer
    return (*got, took)


@pytest.mark.parametrize(
    ("u", "what", "expect"),
    [
        (2, "window", "window_size is (-1, -1) on ranks 0-2, (4, 0) on rank 3"),
        (2, "scale", "softmax_scale is 0.35355339059327373 on ranks 0-2, 0.3 on rank 3"),
        (2, "mask", r"the mask (documents, window or layout given to ring_mask) is "),
        (2, "no_head_group", "call is hybrid attention (u = 2 head × r = 2 ring ranks) on ranks 0-2, ring attention "
                            "over 2 rank(s) on rank 3"),
        (4, "no_head_group", "ring attention over 1 rank(s) on rank 3"),  # a ring of one: no check of its own
    ],
    ids=["window", "scale", "mask", "no-head-group", "no-head-group-ring-of-one"],
)  # fmt: skip
def test_disagreeing_grid_raises_everywhere(u, what, expect):
    results = run_ranks(_call, 4, (u, what), timeout_s=TIMEOUT_S)
    for rank, (kind, msg, took) in enumerate(results):
        assert kind == "ValueError", (rank, kind, msg)
        assert "inputs differ between the ranks of the group" in msg and expect in msg, (rank, msg)
        assert took < TIMEOUT_S / 2, (rank, took)  # answered, not timed out


def _timeouts(rank, world):
    ring_g, head_g = hybrid_groups(2)
    return [g._get_backend(torch.device("cpu")).options._timeout.total_seconds() for g in (ring_g, head_g)]


def test_hybrid_groups_wait_as_long_as_their_parent():
    assert run_ranks(_timeouts, 4, timeout_s=TIMEOUT_S) == [[TIMEOUT_S, TIMEOUT_S]] * 4


@pytest.mark.parametrize(("what", "own"), [("bad_q", "q must have 4 dims"), ("bad_window_size", "window_size=(3, 1)")])
def test_a_rank_that_rejects_its_inputs_is_named_by_its_global_rank(what, own):
    results = run_ranks(_call, 4, (2, what), timeout_s=TIMEOUT_S)
    for rank, (kind, msg, took) in enumerate(results):
        assert kind == "ValueError" and took < TIMEOUT_S / 2, (rank, kind, msg)
        if rank == 3:
            assert own in msg, msg
        else:  # rank 3 of the world, whatever its rank in the head or ring group
            assert "rank(s) [3] of the group rejected their inputs" in msg, (rank, msg)
