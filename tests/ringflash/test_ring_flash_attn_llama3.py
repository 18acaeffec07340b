"""The drop-in's stripe and llama3 (all-gather) names against float64, on 1-4 gloo ranks.

- `llama3_flash_attn_prepare_cu_seqlens` against the peer's documented semantics, derived here
  token by token (which documents touch this rank's slice, where their keys start and end).
- `llama3_flash_attn_varlen_*`: the packed sequence split contiguously, K/V gathered in head
  chunks; o, lse, dq, dk, dv against float64 attention per document, causal or not, windows.
- `stripe_flash_attn_*`: the stripe layout through the peer's signatures.
- Bad input on one rank raises on every rank.
"""

from __future__ import annotations

import inspect

import pytest
import torch

from ringflash import ring_flash_attn as peer
from ringflash import shard
from tests.dist_utils import run_ranks
from tests.ringflash.test_ring_flash_attn import FLASH, _truth
from tests.truth import TOL, attention_f64, lse_err, rel_err

LLAMA3 = ["cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "heads_k_stride", "local_k_slice"]


def test_llama3_signatures_are_the_peers():
    heads = {"func": ["q", "k", "v"], "kvpacked": ["q", "kv"], "qkvpacked": ["qkv"]}
    for name in ("func", "kvpacked_func", "qkvpacked_func"):
        params = list(inspect.signature(getattr(peer, f"llama3_flash_attn_varlen_{name}")).parameters)
        assert params == heads[name.removesuffix("_func") or "func"] + LLAMA3 + FLASH, name
    params = inspect.signature(peer.llama3_flash_attn_prepare_cu_seqlens).parameters
    assert list(params) == ["cu_seqlens", "causal", "rank", "world_size"]


def _expected(cu, causal, rank, world):
    """The peer's prepare_cu_seqlens, token by token from its documentation."""
    total = cu[-1]
    n = total // world
    lo, hi = rank * n, (rank + 1) * n
    doc = torch.repeat_interleave(torch.arange(len(cu) - 1), torch.diff(torch.tensor(cu)))
    mine = doc[lo:hi].unique().tolist()  # the documents this rank's queries belong to, in order
    q_len = [int((doc[lo:hi] == d).sum()) for d in mine]
    start = cu[mine[0]]  # the first of them starts here (maybe on an earlier rank)
    stop = hi if causal else cu[mine[-1] + 1]
    k_len = [min(cu[d + 1], stop) - max(cu[d], start) for d in mine]
    cum = lambda ls: [sum(ls[:i]) for i in range(len(ls) + 1)]
    return cum(q_len), cum(k_len), max(q_len), max(k_len), slice(start, stop)


@pytest.mark.parametrize("cu", [[0, 5, 12, 20, 24], [0, 24], [0, 6, 12, 18, 24], [0, 1, 2, 23, 24], [0, 3, 4, 24]])
@pytest.mark.parametrize("causal", [False, True])
def test_prepare_cu_seqlens(cu, causal):
    for world in (1, 2, 3, 4):
        for rank in range(world):
            got = peer.llama3_flash_attn_prepare_cu_seqlens(torch.tensor(cu, dtype=torch.int32), causal, rank, world)
            want = _expected(cu, causal, rank, world)
            assert [got[0].tolist(), got[1].tolist(), *got[2:]] == list(want), (world, rank)
            assert got[0].dtype == torch.int32


LENGTHS = [1, 17, 40, 3, 35]  # 96 tokens: documents cross every rank boundary for 2-4 ranks


def _llama3_worker(rank, world, causal, window_size, packed, stride):
    g = torch.Generator().manual_seed(0)
    total, H, Hkv, D = sum(LENGTHS), 4, 2, 16
    q, do = torch.randn(total, H, D, generator=g), torch.randn(total, H, D, generator=g)
    k, v = torch.randn(total, Hkv, D, generator=g), torch.randn(total, Hkv, D, generator=g)
    if packed == "qkv":  # MHA: one head count for q, k, v
        k, v = k.repeat_interleave(H // Hkv, 1), v.repeat_interleave(H // Hkv, 1)
    window = window_size[0] + 1 if window_size[0] >= 0 else None
    truth = _truth(q, k, v, do, LENGTHS, causal, window)
    n = total // world
    rows = slice(rank * n, (rank + 1) * n)
    cu = torch.tensor([sum(LENGTHS[:i]) for i in range(len(LENGTHS) + 1)], dtype=torch.int32)
    cu_q, cu_k, max_q, max_k, k_slice = peer.llama3_flash_attn_prepare_cu_seqlens(cu, causal, rank, world)
    args = (cu_q, cu_k, max_q, max_k, stride, k_slice, 0.0, None, causal, window_size)
    ql, kl, vl = (t[rows].clone().requires_grad_() for t in (q, k, v))
    if packed == "qkv":
        qkv = torch.stack([ql.detach(), kl.detach(), vl.detach()], 1).requires_grad_()
        o, lse, _ = peer.llama3_flash_attn_varlen_qkvpacked_func(qkv, *args, return_attn_probs=True)
        o.backward(do[rows])
        grads = {"dq": qkv.grad[:, 0], "dk": qkv.grad[:, 1], "dv": qkv.grad[:, 2]}
    elif packed == "kv":
        kv = torch.stack([kl.detach(), vl.detach()], 1).requires_grad_()
        o, lse, _ = peer.llama3_flash_attn_varlen_kvpacked_func(ql, kv, *args, return_attn_probs=True)
        o.backward(do[rows])
        grads = {"dq": ql.grad, "dk": kv.grad[:, 0], "dv": kv.grad[:, 1]}
    else:
        o, lse, _ = peer.llama3_flash_attn_varlen_func(ql, kl, vl, *args, return_attn_probs=True)
        o.backward(do[rows])
        grads = {"dq": ql.grad, "dk": kl.grad, "dv": vl.grad}
    assert o.shape == (n, H, D) and lse.shape == (H, n)
    errs = {name: rel_err(x, truth[name][rows]) for name, x in {"o": o, **grads}.items()}
    errs["lse"] = lse_err(lse, truth["lse"][:, rows]) / 10
    assert all(e < TOL[torch.float32] for e in errs.values()), f"rank {rank}: {errs}"
    return errs


@pytest.mark.parametrize(
    "world,causal,window_size,packed,stride",
    [
        (1, True, (-1, -1), "", 1),
        (2, True, (-1, -1), "", 1),
        (3, False, (-1, -1), "", 2),
        (4, True, (-1, -1), "kv", 1),
        (4, True, (6, 0), "", 2),
        (2, True, (-1, -1), "qkv", 1),
    ],
)
def test_llama3_varlen_matches_float64(world, causal, window_size, packed, stride):
    run_ranks(_llama3_worker, world, (causal, window_size, packed, stride))


def _stripe_worker(rank, world, causal, packed):
    g = torch.Generator().manual_seed(1)
    B, N, H, D = 2, 8 * world, 4, 16
    q, k, v, do = (torch.randn(B, N, H, D, generator=g) for _ in range(4))
    truth = attention_f64(q, k, v, causal, None, do)
    ql, kl, vl = (shard(t, 1, rank, world, "stripe").requires_grad_() for t in (q, k, v))
    if packed:
        qkv = torch.stack([ql.detach(), kl.detach(), vl.detach()], 2).requires_grad_()
        o, lse, _ = peer.stripe_flash_attn_qkvpacked_func(qkv, causal=causal, return_attn_probs=True)
        o.backward(shard(do, 1, rank, world, "stripe"))
        got = {"o": o, "dq": qkv.grad[:, :, 0], "dk": qkv.grad[:, :, 1], "dv": qkv.grad[:, :, 2]}
    else:
        o, lse, _ = peer.stripe_flash_attn_func(ql, kl, vl, 0.0, None, causal, return_attn_probs=True)
        o.backward(shard(do, 1, rank, world, "stripe"))
        got = {"o": o, "dq": ql.grad, "dk": kl.grad, "dv": vl.grad}
    errs = {name: rel_err(x, shard(truth[name], 1, rank, world, "stripe")) for name, x in got.items()}
    errs["lse"] = lse_err(lse, shard(truth["lse"], 2, rank, world, "stripe")) / 10
    assert all(e < TOL[torch.float32] for e in errs.values()), f"rank {rank}: {errs}"


@pytest.mark.parametrize("world,causal,packed", [(2, True, False), (3, True, True), (4, False, False)])
def test_stripe_matches_float64(world, causal, packed):
    run_ranks(_stripe_worker, world, (causal, packed))


def _llama3_error_worker(rank, world, what):
    q, k, v = (torch.randn(8, 2, 16) for _ in range(3))
    cu = torch.tensor([0, 5, 16], dtype=torch.int32)
    cu_q, cu_k, max_q, max_k, k_slice = peer.llama3_flash_attn_prepare_cu_seqlens(cu, True, rank, world)
    stride = 0 if what == "stride" and rank == 1 else 1
    if what == "slice" and rank == 0:
        k_slice = slice(0, 99)
    if what == "cu_k" and rank == 1:
        cu_k = cu_k[:-1]
    try:
        peer.llama3_flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, stride, k_slice, causal=True)
    except (TypeError, ValueError) as e:
        return str(e)
    return None


@pytest.mark.parametrize(
    "what,first,match",
    [
        ("stride", 1, "heads_k_stride must be a positive int"),
        ("slice", 0, r"local_k_slice must be a slice\(start, stop\) in the 16 gathered keys, got slice\(0, 99, None\)"),
        ("cu_k", 1, "cu_seqlens_k must"),
    ],
)
def test_llama3_bad_input_raises_on_every_rank(what, first, match):
    import re

    msgs = run_ranks(_llama3_error_worker, 2, (what,))
    assert re.search(match, msgs[first] or ""), msgs
    assert "rejected their inputs" in (msgs[1 - first] or ""), msgs
