"""Head-parallel × ring attention (ringflash/hybrid.py) equals float64 truth on the unsharded sequence.

One `run_ranks` per grid (u head ranks × r ring ranks, groups from `hybrid_groups`), looping
inside over layout × causal × GQA and the masks, so the forks are paid once per grid. Every rank
builds the global q, k, v, do and document ids from a seed, shards them with
`shard(..., head_rank=, head_world=)`, and compares o, lse, dq, dk, dv with its shard of the
float64 truth (tests/ringflash/test_ring_masks.py's masked reference).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from ringflash import global_positions, hybrid_groups, ring_flash_attn_func, ring_mask, shard, unshard
from ringflash.hybrid import grid_coords, kv_heads_per_rank
from tests.dist_utils import RankFailure, run_ranks
from tests.ringflash.test_ring_masks import allowed, masked_attention_f64
from tests.truth import TOL, lse_err, rel_err

N, B, D = 48, 2, 16  # N splits over r ∈ {1, 2, 3} ring ranks (both layouts) × u ∈ {1, 2, 4}
DOCS = [[1, 9, 20, 3, 15], [25, 1, 22]]


def _doc_ids() -> torch.Tensor:
    return torch.stack([torch.repeat_interleave(torch.arange(len(ls)), torch.tensor(ls)) for ls in DOCS])


def _configs(u: int) -> list[dict]:
    heads = [(4, 4), (4, 2), (4, 1)] if u <= 2 else [(4, 4), (4, 2), (4, 1), (8, 4)]
    out = [dict(layout=lay, causal=c, H=H, Hkv=Hkv, docs=False, window=None)
           for lay in ("zigzag", "contiguous") for c in (True, False) for H, Hkv in heads]  # fmt: skip
    out += [
        dict(layout="zigzag", causal=True, H=4, Hkv=1, docs=True, window=None),
        dict(layout="contiguous", causal=False, H=4, Hkv=2, docs=True, window=None),
        dict(layout="zigzag", causal=True, H=4, Hkv=2, docs=False, window=5),
        dict(layout="contiguous", causal=True, H=4, Hkv=4, docs=True, window=7),
        dict(layout="zigzag", causal=True, H=4, Hkv=2, docs=False, window=None, Dv=8),  # v's own head dim
        dict(layout="contiguous", causal=False, H=4, Hkv=1, docs=True, window=None, Dv=24),
    ]
    return out


def grid_worker(rank, world, u):
    ring_g, head_g = hybrid_groups(u)
    ring_rank, head_rank = grid_coords(rank, u)
    assert (dist.get_rank(ring_g), dist.get_rank(head_g)) == (ring_rank, head_rank)
    r = world // u
    errs = []
    for i, c in enumerate(_configs(u)):
        g = torch.Generator().manual_seed(i)
        dv = c.get("Dv", D)
        q, do = torch.randn(B, N, c["H"], D, generator=g), torch.randn(B, N, c["H"], dv, generator=g)
        k, v = torch.randn(B, N, c["Hkv"], D, generator=g), torch.randn(B, N, c["Hkv"], dv, generator=g)
        doc = _doc_ids() if c["docs"] else None
        truth = masked_attention_f64(q, k, v, do, allowed(doc, N, c["causal"], c["window"]))

        def sh(x, dim=1, c=c):
            return shard(x, dim, ring_rank, r, c["layout"], head_rank=head_rank, head_world=u)

        ql, kl, vl = (sh(t).clone().requires_grad_() for t in (q, k, v))
        mask = None
        if doc is not None:
            mask = ring_mask(doc, group=ring_g, layout=c["layout"], causal=c["causal"], window=c["window"])
        o, lse, _ = ring_flash_attn_func(
            ql, kl, vl, causal=c["causal"], group=ring_g, head_group=head_g, layout=c["layout"], return_attn_probs=True,
            backend="reference", mask=mask,
            window_size=(c["window"] - 1, 0) if c["window"] and mask is None else (-1, -1),
        )  # fmt: skip
        o.backward(sh(do))
        tol = TOL[torch.float32]
        e = {
            "o": rel_err(o, sh(truth["o"])),
            "dq": rel_err(ql.grad, sh(truth["dq"])),
            "dk": rel_err(kl.grad, sh(truth["dk"])),
            "dv": rel_err(vl.grad, sh(truth["dv"])),
        }
        e_lse = lse_err(lse, sh(truth["lse"], 2))
        if max(e.values()) > tol or e_lse > 1e-5:
            errs.append((c, e, e_lse))
        # Positions agree with the shard of arange (what RoPE and the masks use).
        pos = global_positions(N // world, ring_rank, r, c["layout"], head_rank=head_rank, head_world=u)
        assert torch.equal(pos, sh(torch.arange(N)[None], 1)[0])
    return errs


@pytest.mark.parametrize("u, r", [(2, 1), (1, 2), (2, 2), (4, 1), (2, 3)])
def test_hybrid_equals_truth(u, r):
    results = run_ranks(grid_worker, u * r, (u,), timeout_s=90)
    assert results == [[]] * (u * r), results


def test_shard_unshard_grid():
    x = torch.arange(2 * 48).view(2, 48)
    for layout in ("zigzag", "contiguous"):
        shards = [shard(x, 1, c // 2, 3, layout, head_rank=c % 2, head_world=2) for c in range(6)]
        assert torch.equal(unshard(shards, 1, layout, head_world=2), x)


def test_kv_heads_rule():
    assert kv_heads_per_rank(32, 8, 4) == 2
    assert kv_heads_per_rank(32, 2, 8) == 1  # replicated: each K/V head on 4 head ranks
    with pytest.raises(ValueError, match=r"q.shape\[2\] \(H = 6 heads\) must be divisible by the head-parallel"):
        kv_heads_per_rank(6, 6, 4)
    with pytest.raises(ValueError, match=r"k.shape\[2\] \(Hkv = 6 K/V heads\) and the head-parallel degree u = 4"):
        kv_heads_per_rank(24, 6, 4)


def bad_worker(rank, world, what):
    ring_g, head_g = hybrid_groups(2)
    H = 3 if what == "heads" and rank == 1 else 4  # only rank 1 has a bad head count
    H = 6 if what == "heads_all" else H
    Hkv = 3 if what == "heads_all" else H
    q = torch.randn(1, 8, H, 8)
    kv = torch.randn(1, 8, Hkv, 8)
    if what == "grid":
        ring_g = head_g  # the same group twice: not a grid
    try:
        ring_flash_attn_func(q, kv, kv, causal=True, group=ring_g, head_group=head_g, backend="reference")
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("what", ["heads", "heads_all", "grid"])
def test_bad_inputs_raise_everywhere(what):
    msgs = run_ranks(bad_worker, 4, (what,), timeout_s=20)
    assert all(m != "no error" for m in msgs), msgs
    if what == "heads":
        assert "H = 3 heads" in msgs[1] and "must be divisible by the head-parallel degree u = 2" in msgs[1]
        assert all("rejected their inputs" in m for i, m in enumerate(msgs) if i != 1), msgs
    if what == "heads_all":
        assert all("Hkv = 3 K/V heads" in m for m in msgs), msgs
    if what == "grid":
        assert all("must meet only in this rank" in m for m in msgs), msgs


def test_rank_failure_is_assertion():  # the helper's contract the tests above rely on
    assert issubclass(RankFailure, AssertionError)
