"""Softcapping and learnable sinks through the ring: values and gradients (the sink's included)
on 1, 2 and 4 gloo ranks against a float64 ground truth with flash_attn's criterion, and the
refusals of bad values on every rank."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from ringflash import RingFlashAttention, ring_flash_attn_func
from ringflash.kernels import interpreting
from ringflash.layout import shard
from tests.dist_utils import run_ranks
from tests.truth_features import assert_close, attention, band


def _inputs(c):
    """Global q, k, v, do `(B, W·n, heads, D)` and a sink `(H,)` near the rows' lse, so it matters."""
    g = torch.Generator().manual_seed(c.get("seed", 0))
    B, N, H, Hkv, D = 2, c["world"] * c["n"], 4, 2, c.get("D", 16)
    mk = lambda *s, a=1.0: (a * torch.randn(*s, generator=g)).to(c["dtype"])
    q, k, v, do = mk(B, N, H, D, a=2.0), mk(B, N, Hkv, D, a=2.0), mk(B, N, Hkv, D), mk(B, N, H, D)
    sink = (torch.randn(H, generator=g) + 3.0) if c["sink"] else None
    return q, k, v, do, sink


def features_worker(rank, world, c):
    q, k, v, do, sink = _inputs(c)
    dev = torch.device(c.get("device", "cpu"))
    if dev.type == "cuda":
        torch.cuda.set_device(0)  # every rank shares the one GPU (gloo stages through host memory)
    N, L = q.shape[1], "zigzag"
    visible = band(N, N, causal=True) if c["causal"] else None
    kw = dict(visible=visible, softcap=c["softcap"], sink=sink, do=do)
    truth, naive = attention(q, k, v, **kw), attention(q, k, v, **kw, dtype=c["dtype"])
    ql, kl, vl = (shard(t, 1, rank, world, L).to(dev).requires_grad_() for t in (q, k, v))
    param = None if sink is None else torch.nn.Parameter(sink.to(dev))
    o = ring_flash_attn_func(ql, kl, vl, causal=c["causal"], layout=L, backend=c["backend"], softcap=c["softcap"],
                             learnable_sink=param)  # fmt: skip
    o.backward(shard(do, 1, rank, world, L).to(dev))
    got = {key: t.cpu() for key, t in dict(o=o, dq=ql.grad, dk=kl.grad, dv=vl.grad).items()}
    local = {key: shard(truth[key], 1, rank, world, L) for key in got}
    local_naive = {key: shard(naive[key], 1, rank, world, L) for key in got}
    keys = ["o", "dq", "dk", "dv"]
    if param is not None:
        # Each rank's gradient covers its own rows: reduced over the group, as a trainer reduces it.
        got["dsink"] = param.grad.cpu()
        if world > 1:
            dist.all_reduce(got["dsink"])
        local["dsink"], local_naive["dsink"] = truth["dsink"], naive["dsink"]
        keys.append("dsink")
    assert_close(got, local, local_naive, c["dtype"], keys)
    return float((got["o"].double() - local["o"]).abs().max())


def _case(world, causal=True, softcap=0.0, sink=False, dtype=torch.float32, backend="reference", n=8, **gpu):
    return dict(world=world, causal=causal, softcap=softcap, sink=sink, dtype=dtype, backend=backend, n=n, **gpu)


CASES = [
    _case(w, causal, softcap, sink, dtype)
    for w in (1, 2, 4)
    for causal, softcap, sink in ((True, 5.0, False), (False, 5.0, False), (True, 0.0, True), (False, 5.0, True))
    for dtype in (torch.float32, torch.bfloat16)
]
TRITON_CASES = [
    _case(2, True, 5.0, True, torch.bfloat16, "triton", n=16),
    _case(2, False, 5.0, False, backend="triton"),
]


def _id(c):
    return (f"w{c['world']}-{'causal' if c['causal'] else 'full'}-cap{c['softcap']:g}{'-sink' if c['sink'] else ''}-"
            f"{str(c['dtype']).removeprefix('torch.')}-{c['backend']}")  # fmt: skip


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_softcap_and_sink_match_float64(case):
    run_ranks(features_worker, case["world"], (case,))


@pytest.mark.parametrize("case", TRITON_CASES, ids=_id)
def test_softcap_and_sink_triton_interpreted(case):
    if not interpreting():
        pytest.skip("covered by the gpu tests")
    run_ranks(features_worker, case["world"], (case,))


HOPPER_CASES = [  # the Gluon kernels on every step (strict: handing a step on to Triton raises)
    _case(2, causal, softcap, sink, dtype, "hopper", n=300, D=D, device="cuda")
    for causal, softcap, sink, dtype, D in (
        (True, 5.0, True, torch.bfloat16, 128),
        (False, 5.0, False, torch.float16, 64),
        (True, 0.0, True, torch.float16, 64),
    )
]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                    reason="the Hopper kernels need an sm_90 GPU")
@pytest.mark.parametrize("case", HOPPER_CASES, ids=_id)
def test_softcap_and_sink_on_the_gluon_kernels(case, monkeypatch):
    monkeypatch.setenv("RINGFLASH_STRICT_BACKEND", "1")
    # spawn, not fork: conftest has already asked CUDA whether it is available.
    run_ranks(features_worker, case["world"], (case,), start_method="spawn", timeout_s=120)


def _rounded_once_worker(rank, world):
    # The sink rescales the float32 merged o, rounded to bf16 once after it: with float32 math (the
    # reference kernels) o is the float64 truth rounded, element for element. Rounding o before the
    # rescale and again after it misses about a fifth of them.
    c = _case(world, sink=True, dtype=torch.bfloat16, n=16)
    q, k, v, _, sink = _inputs(c)
    truth = attention(q, k, v, visible=band(q.shape[1], q.shape[1], causal=True), sink=sink)["o"]
    ql, kl, vl = (shard(t, 1, rank, world, "zigzag") for t in (q, k, v))
    o = ring_flash_attn_func(ql, kl, vl, causal=True, backend="reference", learnable_sink=sink)
    missed = (o != shard(truth, 1, rank, world, "zigzag").to(torch.bfloat16)).float().mean().item()
    assert missed < 0.01, f"rank {rank}: {missed:.1%} of o differs from the truth rounded once"


@pytest.mark.parametrize("world", [1, 2])
def test_sink_output_is_rounded_once(world):
    run_ranks(_rounded_once_worker, world)


def test_sink_and_softcap_change_the_result():
    # Guards the comparisons above against features that are silently ignored.
    c = _case(1, sink=True)
    q, k, v, _, sink = _inputs(c)
    plain = ring_flash_attn_func(q, k, v, causal=True)
    assert (ring_flash_attn_func(q, k, v, causal=True, learnable_sink=sink) - plain).abs().max() > 1e-2
    assert (ring_flash_attn_func(q, k, v, causal=True, softcap=2.0) - plain).abs().max() > 1e-2


def test_module_takes_softcap_and_a_sink_per_call():
    c = _case(1, sink=True)
    q, k, v, _, sink = _inputs(c)
    attn = RingFlashAttention(softcap=5.0)
    assert "softcap=5.0" in repr(attn)
    want = ring_flash_attn_func(q, k, v, causal=True, softcap=5.0, learnable_sink=sink)
    torch.testing.assert_close(attn(q, k, v, learnable_sink=sink), want, rtol=0, atol=0)


def _error_worker(rank, world, what):
    c = _case(world, sink=True)
    q, k, v, _, sink = _inputs(c)
    q, k, v = (shard(t, 1, rank, world, "zigzag") for t in (q, k, v))
    kwargs = dict(causal=True, learnable_sink=sink)
    other = r"rank\(s\) \[1\] of the group rejected"
    if what == "negative_softcap":
        kwargs["softcap"], expect = (-1.0 if rank == 1 else 0.0), ("softcap must be >= 0" if rank == 1 else other)
    elif what == "sink_heads":
        kwargs["learnable_sink"] = sink[:3] if rank == 1 else sink
        expect = r"learnable_sink must have shape \(H,\) = \(4,\)" if rank == 1 else other
    elif what == "sink_dtype":
        kwargs["learnable_sink"] = sink.double() if rank == 1 else sink
        expect = "learnable_sink must be float32" if rank == 1 else other
    elif what == "softcap_differs":  # each rank's own input is fine: the agreement check names it
        kwargs["softcap"], expect = (5.0 if rank == 1 else 5.5), "softcap is 5.5 on ranks 0, 2, 5.0 on rank 1"
    elif what == "sink_on_one_rank":
        kwargs["learnable_sink"] = sink if rank == 1 else None
        expect = r"learnable_sink is None on ranks 0, 2, \(4,\) on rank 1"
    with pytest.raises((ValueError, TypeError), match=expect) as err:
        ring_flash_attn_func(q, k, v, **kwargs)
    ring_flash_attn_func(q, k, v, causal=True)  # nothing left in flight: the group still runs
    return str(err.value)


@pytest.mark.parametrize(
    "what", ["negative_softcap", "sink_heads", "sink_dtype", "softcap_differs", "sink_on_one_rank"]
)
def test_bad_softcap_and_sink_raise_on_every_rank(what):
    assert len(run_ranks(_error_worker, 3, (what,), timeout_s=20)) == 3


def _hybrid_worker(rank, world, u):
    """Head parallel × ring: each head rank applies its heads' slice of the sink."""
    from ringflash import hybrid_groups
    from ringflash.hybrid import grid_coords

    ring_g, head_g = hybrid_groups(u)
    ring_rank, head_rank = grid_coords(rank, u)
    r = world // u
    c = _case(world, sink=True, n=4)
    q, k, v, do, sink = _inputs(c)
    N = q.shape[1]
    truth = attention(q, k, v, visible=band(N, N, causal=True), softcap=5.0, sink=sink, do=do)
    sh = lambda x: shard(x, 1, ring_rank, r, "zigzag", head_rank=head_rank, head_world=u)
    ql, kl, vl = (sh(t).clone().requires_grad_() for t in (q, k, v))
    param = torch.nn.Parameter(sink.clone())
    o = ring_flash_attn_func(ql, kl, vl, causal=True, group=ring_g, head_group=head_g, backend="reference",
                             softcap=5.0, learnable_sink=param)  # fmt: skip
    o.backward(sh(do))
    dist.all_reduce(param.grad)  # over the whole cp group, as a trainer reduces replicated gradients
    for got, want in ((o, sh(truth["o"])), (ql.grad, sh(truth["dq"])), (kl.grad, sh(truth["dk"])),
                      (vl.grad, sh(truth["dv"])), (param.grad, truth["dsink"])):  # fmt: skip
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)


def test_hybrid_slices_the_sink_by_head_rank():
    run_ranks(_hybrid_worker, 4, (2,))


def test_ring_op_opcheck_with_softcap_and_sink():
    # torch.compile's view of the op (fake implementation, autograd formula with the sink's gradient).
    c = _case(1, sink=True)
    q, k, v, _, sink = _inputs(c)
    q, k, v, sink = (t.requires_grad_() for t in (q, k, v, sink))
    opts = dict(causal=True, softmax_scale=0.25, layout="zigzag", group_name="", backend=None, check_ranks=False,
                softcap=5.0)  # fmt: skip
    torch.library.opcheck(torch.ops.ringflash.ring_attn.default, (q, k, v, [], sink), opts)
