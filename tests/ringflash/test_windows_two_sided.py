"""Two-sided local windows (flash_attn's `window_size=(left, right)` with causal=False): per-row key
intervals by global position, in the kernels and through the ring on 1, 2 and 4 gloo ranks and
both layouts, against a float64 ground truth; the drop-in module's `window_size`; the refusals."""

from __future__ import annotations

import pytest
import torch

from ringflash import ring_flash_attn as drop_in
from ringflash import ring_flash_attn_func, ring_mask
from ringflash.kernels import AttnSpec, attn_bwd, attn_fwd, check_window, interpreting
from ringflash.layout import shard
from tests.dist_utils import run_ranks
from tests.truth_features import assert_close, attention, band


def _inputs(B, N, H, Hkv, D, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g).to(dtype)
    return mk(B, N, H, D), mk(B, N, Hkv, D), mk(B, N, Hkv, D), mk(B, N, H, D)


@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("window", [(7, 3), (0, 20), (30, -1), (-1, 5)], ids=str)
def test_kernels_two_sided_window(window, dtype, backend):
    q, k, v, do = _inputs(1, 97, 2, 1, 32, dtype)
    spec = AttnSpec(window=window)
    truth = attention(q, k, v, visible=band(97, 97, *window), do=do)
    naive = attention(q, k, v, visible=band(97, 97, *window), do=do, dtype=dtype)
    o, lse = attn_fwd(q, k, v, spec=spec, backend=backend)
    dq, dk, dv = attn_bwd(do, q, k, v, o, lse, spec=spec, backend=backend)
    assert_close(dict(o=o, dq=dq, dk=dk, dv=dv), truth, naive, dtype)


def window_worker(rank, world, c):
    N = world * c["n"]
    q, k, v, do = _inputs(2, N, 4, 2, 16, c["dtype"])
    visible = band(N, N, *c["window"])
    kw = dict(visible=visible, softcap=c["softcap"], do=do)
    truth, naive = attention(q, k, v, **kw), attention(q, k, v, **kw, dtype=c["dtype"])
    L = c["layout"]
    ql, kl, vl = (shard(t, 1, rank, world, L).detach().clone().requires_grad_() for t in (q, k, v))
    # flash_attn's positional order: dropout_p, softmax_scale, causal, window_size
    o = ring_flash_attn_func(ql, kl, vl, 0.0, None, False, c["window"], layout=L, backend=c["backend"],
                             softcap=c["softcap"])  # fmt: skip
    o.backward(shard(do, 1, rank, world, L))
    got = {"o": o, "dq": ql.grad, "dk": kl.grad, "dv": vl.grad}
    local = {key: shard(truth[key], 1, rank, world, L) for key in got}
    local_naive = {key: shard(naive[key], 1, rank, world, L) for key in got}
    assert_close(got, local, local_naive, c["dtype"])
    mask = ring_mask(None, seqlen=N, layout=L, causal=False, window=c["window"])
    return mask.skipped


def _case(world, layout, window, dtype=torch.float32, softcap=0.0, backend="reference", n=8):
    return dict(world=world, layout=layout, window=window, dtype=dtype, softcap=softcap, backend=backend, n=n)


CASES = [
    _case(w, layout, window, dtype)
    for w in (1, 2, 4)
    for layout in ("zigzag", "contiguous")
    for window in ((3, 2), (0, 9))
    for dtype in (torch.float32, torch.bfloat16)
] + [_case(4, "zigzag", (5, 1), softcap=5.0)]


def _id(c):
    return f"w{c['world']}-{c['layout']}-{c['window']}-{str(c['dtype']).removeprefix('torch.')}-cap{c['softcap']:g}"


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_ring_two_sided_window_matches_float64(case):
    run_ranks(window_worker, case["world"], (case,))


def test_ring_two_sided_window_triton_interpreted():
    if not interpreting():
        pytest.skip("covered by the gpu tests")
    run_ranks(window_worker, 2, (_case(2, "zigzag", (5, 9), torch.bfloat16, 5.0, "triton", n=16),))


def test_narrow_window_skips_far_steps():
    # 4 contiguous ranks of 8 tokens, window (3, 2): only neighbouring chunks meet. Step s brings
    # rank r the block of rank (r - s) mod 4, so rank 0 computes only step 3 (rank 1's keys).
    skipped = run_ranks(window_worker, 4, (_case(4, "contiguous", (3, 2)),))
    assert [list(s) for s in skipped] == [[1, 2], [2], [2], [2, 3]]


def _drop_in_worker(rank, world):
    N = 16 * world
    q, k, v, _ = _inputs(1, N, 2, 2, 16, torch.float32)
    truth = attention(q, k, v, visible=band(N, N, 4, 6))
    loc = [shard(t, 1, rank, world, "zigzag") for t in (q, k, v)]
    o = drop_in.zigzag_ring_flash_attn_func(*loc, 0.0, None, False, (4, 6))
    torch.testing.assert_close(o.double(), shard(truth["o"], 1, rank, world, "zigzag"), rtol=1e-4, atol=1e-5)


def test_drop_in_takes_window_size():
    run_ranks(_drop_in_worker, 2)


def _error_worker(rank, world, what):
    q, k, v, _ = _inputs(1, 8 * world, 2, 2, 16, torch.float32)
    q, k, v = (shard(t, 1, rank, world, "zigzag") for t in (q, k, v))
    other = r"rank\(s\) \[1\] of the group rejected"
    kwargs = {}
    if what == "right_with_causal":
        kwargs = dict(causal=True, window_size=(3, 1) if rank == 1 else (3, 0))
        expect = r"window_size=\(3, 1\) with causal=True" if rank == 1 else other
    elif what == "below_minus_one":
        kwargs = dict(causal=False, window_size=(-2, 3) if rank == 1 else (2, 3))
        expect = r"window_size=\(-2, 3\): entries must be >= 0" if rank == 1 else other
    elif what == "window_differs":  # fine on each rank: the agreement check names it
        kwargs = dict(causal=False, window_size=(2, 3) if rank == 1 else (2, 4))
        expect = "window_size"
    with pytest.raises(ValueError, match=expect) as err:
        ring_flash_attn_func(q, k, v, **kwargs)
    ring_flash_attn_func(q, k, v, causal=True)  # nothing left in flight
    return str(err.value)


@pytest.mark.parametrize("what", ["right_with_causal", "below_minus_one", "window_differs"])
def test_bad_window_size_raises_on_every_rank(what):
    assert len(run_ranks(_error_worker, 3, (what,), timeout_s=20)) == 3


def test_check_window_names_the_pair():
    with pytest.raises(ValueError, match="two-sided window"):
        check_window((3, 2), causal=True)
    with pytest.raises(TypeError, match="pair of ints"):
        check_window((3, 2.0), causal=False)
    with pytest.raises(ValueError, match="needs causal=True"):
        check_window(4, causal=False)


def _documents_worker(rank, world, layout):
    """Packed documents and a two-sided window together: `ring_mask(doc_ids, causal=False, window=)`."""
    N = 12 * world
    q, k, v, do = _inputs(1, N, 2, 1, 16, torch.float32, seed=3)
    doc = torch.repeat_interleave(torch.arange(3), torch.tensor([5, N - 12, 7]))
    visible = band(N, N, 4, 2) & (doc[:, None] == doc[None, :])
    truth = attention(q, k, v, visible=visible, do=do)
    ql, kl, vl = (shard(t, 1, rank, world, layout).detach().clone().requires_grad_() for t in (q, k, v))
    mask = ring_mask(doc, layout=layout, causal=False, window=(4, 2))
    o = ring_flash_attn_func(ql, kl, vl, layout=layout, mask=mask, backend="reference")
    o.backward(shard(do, 1, rank, world, layout))
    for got, key in ((o, "o"), (ql.grad, "dq"), (kl.grad, "dk"), (vl.grad, "dv")):
        want = shard(truth[key], 1, rank, world, layout)
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5, msg=lambda m, key=key: f"{key}: {m}")


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_two_sided_window_with_documents(layout):
    run_ranks(_documents_worker, 2, (layout,))


def _hybrid_worker(rank, world):
    from ringflash import hybrid_groups
    from ringflash.hybrid import grid_coords

    ring_g, head_g = hybrid_groups(2)
    ring_rank, head_rank = grid_coords(rank, 2)
    N = 8 * world
    q, k, v, do = _inputs(1, N, 4, 2, 16, torch.float32, seed=4)
    truth = attention(q, k, v, visible=band(N, N, 3, 5), do=do)
    sh = lambda x: shard(x, 1, ring_rank, world // 2, "zigzag", head_rank=head_rank, head_world=2)
    ql, kl, vl = (sh(t).clone().requires_grad_() for t in (q, k, v))
    o = ring_flash_attn_func(ql, kl, vl, 0.0, None, False, (3, 5), group=ring_g, head_group=head_g,
                             backend="reference")  # fmt: skip
    o.backward(sh(do))
    for got, key in ((o, "o"), (ql.grad, "dq"), (kl.grad, "dk"), (vl.grad, "dv")):
        torch.testing.assert_close(got.double(), sh(truth[key]), rtol=1e-4, atol=1e-5)


def test_two_sided_window_head_parallel():
    run_ranks(_hybrid_worker, 4)
