"""Ring attention over 1–4 gloo ranks equals float64 attention on the unsharded sequence.

Every case builds the global q, k, v, do from a seed (the same on every rank), computes the
float64 ground truth with tests/truth.py, runs the ring on each rank's shard, and compares o,
lse, dq, dk, dv with the sharded truth (relative-norm tolerance per dtype, as in the kernel
tests). Low-precision cases must also stay within 2× the error of one kernel call on the whole
sequence, so the ring is held to the single-device standard, not just to the dtype's.

CPU cases run fork-started gloo ranks (tests/dist_utils.py). GPU cases (`gpu`) run 2 and 4
spawn-started gloo ranks sharing one GPU with CUDA tensors and the Triton kernels; the
`multigpu` case runs launch/check_ring_nccl.py under torchrun with NCCL.
"""

from __future__ import annotations

import os
import re

import pytest
import torch
import torch._dynamo  # the ring op imports it on its first call: once here, not in every forked rank
import torch.distributed as dist

import ringflash
from ringflash import RingFlashAttention, ring_flash_attn_func, shard
from ringflash.kernels import attn_bwd, attn_fwd, backend_named, interpreting
from ringflash.layout import ring_schedule
from ringflash.ring import _ring_buffers, kv_views, pack_kv, ring_backward, ring_forward
from ringflash.transport import ring_comm
from tests.dist_utils import REPO, RankFailure, run_ranks, torchrun
from tests.truth import TOL, attention_f64, lse_err, rel_err


def make_case(
    world,
    layout="zigzag",
    causal=True,
    n_local=8,
    B=2,
    H=4,
    Hkv=2,
    D=16,
    dtype=torch.float32,
    backend="reference",
    device="cpu",
    seed=0,
    scale=None,
    strided=False,
    Dv=None,
):
    return dict(
        Dv=Dv or D,
        world=world,
        layout=layout,
        causal=causal,
        n_local=n_local,
        B=B,
        H=H,
        Hkv=Hkv,
        D=D,
        dtype=dtype,
        backend=backend,
        device=device,
        seed=seed,
        scale=scale,
        strided=strided,
    )


def global_inputs(c):
    """Global q, k `(B, W·n_local, heads, D)`, v, do `(…, Dv)` from the case's seed, on the case's device."""
    g = torch.Generator().manual_seed(c["seed"])
    N = c["world"] * c["n_local"]
    shapes = [(c["B"], N, c["H"], c["D"]), (c["B"], N, c["Hkv"], c["D"]), (c["B"], N, c["Hkv"], c["Dv"])]
    q, k, v = (torch.randn(s, generator=g).to(c["device"], c["dtype"]) for s in shapes)
    do = torch.randn((c["B"], N, c["H"], c["Dv"]), generator=g).to(c["device"], c["dtype"])
    return q, k, v, do


def ring_exactness_worker(rank, world, c):
    """Run case `c` on this rank; assert against the truth; return the relative errors."""
    if c["device"] == "cuda":
        torch.cuda.set_device(0)  # every rank shares the one GPU (gloo stages through host memory)
    q, k, v, do = global_inputs(c)
    truth = attention_f64(q, k, v, c["causal"], c["scale"], do)
    L = c["layout"]
    loc = [shard(t, 1, rank, world, L).detach().clone() for t in (q, k, v)]
    if c["strided"]:  # q, k, v as views of one packed tensor, like a fused QKV projection's output
        qkv = torch.cat(loc, dim=2)
        H, Hkv = c["H"], c["Hkv"]
        loc = [qkv[:, :, :H], qkv[:, :, H : H + Hkv], qkv[:, :, H + Hkv :]]
    ql, kl, vl = (t.requires_grad_() for t in loc)
    # flash_attn's positional order: dropout_p, softmax_scale, causal
    o, lse, _ = ring_flash_attn_func(
        ql, kl, vl, 0.0, c["scale"], c["causal"], layout=L, return_attn_probs=True, backend=c["backend"]
    )
    o.backward(shard(do, 1, rank, world, L))
    got = {"o": o, "dq": ql.grad, "dk": kl.grad, "dv": vl.grad}
    assert o.dtype == c["dtype"] and lse.dtype == torch.float32 and lse.shape == (c["B"], c["H"], c["n_local"])
    assert all(g.dtype == c["dtype"] for g in got.values()), "gradients come back in the input dtype"
    errs = {n: rel_err(x, shard(truth[n], 1, rank, world, L)) for n, x in got.items()}
    errs["lse"] = lse_err(lse, shard(truth["lse"], 2, rank, world, L))
    tol = TOL[c["dtype"]]
    assert all(e < tol for n, e in errs.items() if n != "lse"), f"rank {rank}: {errs} exceed {tol}"
    assert errs["lse"] < 10 * tol, f"rank {rank}: lse error {errs['lse']}"
    if c["dtype"] != torch.float32:  # no worse than one kernel call on the whole sequence
        o1, lse1 = attn_fwd(q, k, v, causal=c["causal"], softmax_scale=c["scale"], backend=c["backend"])
        grads1 = attn_bwd(do, q, k, v, o1, lse1, causal=c["causal"], softmax_scale=c["scale"], backend=c["backend"])
        single = dict(zip(("o", "dq", "dk", "dv"), (o1, *grads1)))
        for n, x in single.items():
            base = rel_err(shard(x, 1, rank, world, L), shard(truth[n], 1, rank, world, L))
            assert errs[n] <= 2 * base + tol / 50, f"rank {rank}: {n} error {errs[n]:.2e} vs single {base:.2e}"
    return errs


CPU_CASES = [
    make_case(w, layout, causal, H=4, Hkv=hkv)
    for w in (1, 2, 3, 4)
    for layout in ("contiguous", "zigzag", "stripe")
    for causal in (False, True)
    for hkv in (4, 2)  # MHA and GQA
] + [
    make_case(4, "stripe", True, H=4, Hkv=1, n_local=5, scale=0.3),  # odd local length, MQA
    make_case(3, "zigzag", True, H=4, Hkv=1, strided=True, scale=0.3),  # MQA, views of a packed QKV
    make_case(2, "zigzag", True, dtype=torch.bfloat16, n_local=16),
    make_case(3, "contiguous", True, dtype=torch.float16, n_local=12),
    # 8 ranks, as on an 8-GPU node: longer schedules, both receive buffers reused several times
    make_case(8, "zigzag", True, H=4, Hkv=2),
    make_case(8, "contiguous", True, H=4, Hkv=2),
] + [  # a value head dim of its own (DeepSeek's MLA: 192 and 128), either way round
    make_case(w, layout, causal, H=4, Hkv=2, D=D, Dv=Dv)
    for w, layout, causal, D, Dv in ((2, "zigzag", True, 24, 16), (4, "contiguous", False, 16, 8),
                                     (3, "stripe", True, 8, 24), (4, "zigzag", True, 192, 128))
] + [make_case(2, "zigzag", True, dtype=torch.bfloat16, n_local=16, D=32, Dv=16)]


def _case_id(c):
    return "-".join(
        [
            f"w{c['world']}",
            c["layout"],
            "causal" if c["causal"] else "full",
            f"h{c['H']}kv{c['Hkv']}",
            f"d{c['D']}" + (f"v{c['Dv']}" if c["Dv"] != c["D"] else ""),
            str(c["dtype"]).removeprefix("torch."),
            c["backend"],
        ]
        + (["strided"] if c["strided"] else [])
    )


@pytest.mark.parametrize("case", CPU_CASES, ids=_case_id)
def test_ring_matches_float64(case):
    run_ranks(ring_exactness_worker, case["world"], (case,))


# The Triton kernels under the interpreter (tests/conftest.py sets TRITON_INTERPRET=1 without CUDA).
TRITON_CASES = [
    make_case(2, "zigzag", True, n_local=32, H=4, Hkv=2, D=32, dtype=torch.bfloat16, backend="triton"),
    make_case(3, "contiguous", False, n_local=18, B=1, H=2, Hkv=1, D=32, backend="triton"),
    make_case(3, "stripe", True, n_local=17, B=1, H=2, Hkv=1, D=32, backend="triton"),  # the shifted diagonal
    make_case(2, "zigzag", True, n_local=32, H=4, Hkv=2, D=32, Dv=64, dtype=torch.bfloat16, backend="triton"),
    make_case(3, "contiguous", False, n_local=18, B=1, H=2, Hkv=1, D=64, Dv=32, backend="triton"),
]


@pytest.mark.parametrize("case", TRITON_CASES, ids=_case_id)
def test_ring_triton_kernels_interpreted(case):
    if not interpreting():
        pytest.skip("covered by the gpu tests")
    run_ranks(ring_exactness_worker, case["world"], (case,))


class _RoundedPartials(type(backend_named("reference"))):
    """The reference kernels as a backend whose partial results come rounded to the inputs' dtype,
    as cuDNN's do (only a GPU runs cuDNN), recording the dtype each step wrote or read."""

    def __init__(self):
        self.seen = []

    def partial_dtype(self, dtype):
        return dtype

    def fwd_step(self, q, k, v, spec, scale, *, out_dtype=None, acc=None, out=None):
        o, lse = super().fwd_step(q, k, v, spec, scale, out_dtype=out_dtype, acc=acc, out=out)
        self.seen.append(("fwd", o.dtype if acc is None else acc[0].dtype))
        return o, lse

    def bwd_step(self, do, q, k, v, o, lse, spec, scale, *, grad_dtype=None, acc=None, **kw):
        self.seen.append(("bwd", grad_dtype if acc is None else acc[0].dtype))
        return super().bwd_step(do, q, k, v, o, lse, spec, scale, grad_dtype=grad_dtype, acc=acc, **kw)


def _rounded_partials_worker(rank, world, c):
    """The ring loop handed a fake backend and the group's transport: exact, and at W = 2 step 0's
    results stay in the backend's partial dtype, beyond it in float32."""
    q, k, v, do = global_inputs(c)
    truth = attention_f64(q, k, v, c["causal"], None, do)
    L = c["layout"]
    ql, kl, vl, dol = (shard(t, 1, rank, world, L) for t in (q, k, v, do))
    plan = ring_schedule(rank, world, ql.shape[1], c["causal"], L)
    kern, comm, scale = _RoundedPartials(), ring_comm(None), c["D"] ** -0.5
    o, lse, kv = ring_forward(ql, kl, vl, plan, scale=scale, kernels=kern, comm=comm)
    dq, dkv = ring_backward(dol, ql, kv, o, lse, plan, scale=scale, kernels=kern, comm=comm)
    for name, got in (("o", o), ("dq", dq), *zip(("dk", "dv"), kv_views(dkv, c["D"]))):
        err = rel_err(got, shard(truth[name], 1, rank, world, L))
        assert got.dtype == c["dtype"] and err < TOL[c["dtype"]], f"rank {rank}: {name} error {err}"
    want = c["dtype"] if world == 2 else torch.float32
    steps = sum(st is not None for st in plan)
    assert {dt for _, dt in kern.seen} == {want} and len(kern.seen) == 2 * steps, (world, kern.seen)


def test_ring_with_rounded_partials_at_two_ranks():
    for world, layout, causal in ((2, "zigzag", True), (2, "contiguous", False), (3, "zigzag", True)):
        case = make_case(world, layout, causal, dtype=torch.bfloat16, n_local=16)
        run_ranks(_rounded_partials_worker, world, (case,))


def test_world_one_without_distributed_is_one_kernel_call():
    # No process group at all: ring attention is plain attention, still differentiable.
    if dist.is_initialized():
        pytest.skip("a process group is live in this process; this test needs none")
    c = make_case(1, causal=True, n_local=12)
    q, k, v, do = global_inputs(c)
    q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
    o = RingFlashAttention(causal=True)(q, k, v)
    o.backward(do)
    o1, lse1 = attn_fwd(q, k, v, causal=True)
    torch.testing.assert_close(o, o1, atol=0, rtol=0)
    dq1, dk1, dv1 = attn_bwd(do, q, k, v, o1, lse1, causal=True)
    for got, want in ((q.grad, dq1), (k.grad, dk1), (v.grad, dv1)):
        torch.testing.assert_close(got, want, atol=0, rtol=0)
    assert isinstance(ring_flash_attn_func(q, k, v), torch.Tensor)  # return_attn_probs=False: o alone


def test_packed_layouts_are_views_of_the_same_call():
    # flash_attn's qkvpacked and kvpacked layouts: the same attention and gradients as separate
    # q, k, v (here one process: the ring's strided inputs are the `strided` cases above).
    if dist.is_initialized():
        pytest.skip("a process group is live in this process; this test needs none")
    for H, Hkv in ((4, 4), (4, 2)):
        q, k, v, do = global_inputs(make_case(1, causal=True, n_local=12, H=H, Hkv=Hkv))
        want = ring_flash_attn_func(*(t.requires_grad_() for t in (q, k, v)), causal=True)
        grads = torch.autograd.grad(want, (q, k, v), do)
        kv = torch.stack((k, v), dim=2).detach().requires_grad_()
        q2 = q.detach().clone().requires_grad_()
        o = ringflash.ring_flash_attn_kvpacked_func(q2, kv, causal=True)
        torch.testing.assert_close(o, want, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(torch.autograd.grad(o, (q2, kv), do), (grads[0], torch.stack(grads[1:], 2)))
        if Hkv == H:
            qkv = torch.stack((q, k, v), dim=2).detach().requires_grad_()
            o = ringflash.ring_flash_attn_qkvpacked_func(qkv, 0.0, None, True)  # flash_attn's order
            torch.testing.assert_close(o, want, atol=1e-6, rtol=1e-6)
            torch.testing.assert_close(torch.autograd.grad(o, qkv, do)[0], torch.stack(grads, 2))
    with pytest.raises(ValueError, match=r"qkv must have shape \(batch, seqlen, 3, heads, head_dim\), got \(2, 12, 2"):
        ringflash.ring_flash_attn_qkvpacked_func(kv)
    with pytest.raises(ValueError, match=r"kv must have shape \(batch, seqlen, 2, kv_heads, head_dim\)"):
        ringflash.ring_flash_attn_kvpacked_func(q, k)
    with pytest.raises(TypeError, match=r"qkv must be a torch\.Tensor, got list"):
        ringflash.ring_flash_attn_qkvpacked_func([q, k, v])


def test_default_is_not_causal():
    # flash_attn_func's default: no causal argument and no mask is full attention.
    if dist.is_initialized():
        pytest.skip("a process group is live in this process; this test needs none")
    c = make_case(1, causal=False, n_local=12)
    q, k, v, _ = global_inputs(c)
    truth = attention_f64(q, k, v, False)
    o, lse, _ = ring_flash_attn_func(q, k, v, return_attn_probs=True)
    assert rel_err(o, truth["o"]) < TOL[torch.float32] and lse_err(lse, truth["lse"]) < 10 * TOL[torch.float32]


def test_keys_of_another_local_length_raise():
    # Keys are sharded like queries: a shorter k is a caller's error, not cross-attention.
    if dist.is_initialized():
        pytest.skip("a process group is live in this process; this test needs none")
    q, k, v, _ = global_inputs(make_case(1, n_local=8))
    with pytest.raises(ValueError, match=r"k.shape\[1\] \(local seqlen\) must equal q.shape\[1\] = 8, got 4"):
        ring_flash_attn_func(q, k[:, :4], v[:, :4], causal=True)


def _subgroup_worker(rank, world):
    # Ring over global ranks 1 and 2 only: group ranks differ from global ranks.
    group = dist.new_group([1, 2])
    c = make_case(2, "zigzag", True, n_local=8)
    q, k, v, do = global_inputs(c)
    if rank == 0:
        with pytest.raises(ValueError, match="not a member"):
            ring_flash_attn_func(q, k, v, causal=True, group=group)
        return None
    gr = dist.get_rank(group)
    truth = attention_f64(q, k, v, True, None, do)
    ql, kl, vl = (shard(t, 1, gr, 2).requires_grad_() for t in (q, k, v))
    o = RingFlashAttention(group=group, causal=True)(ql, kl, vl)
    o.backward(shard(do, 1, gr, 2))
    for name, x in (("o", o), ("dq", ql.grad), ("dk", kl.grad), ("dv", vl.grad)):
        assert rel_err(x, shard(truth[name], 1, gr, 2)) < TOL[torch.float32], name
    return gr


def test_subgroup_and_non_member():
    assert run_ranks(_subgroup_worker, 3) == [None, 0, 1]


def _transport_worker(rank, world, env, arg, match):
    if env is not None:
        os.environ["RINGFLASH_TRANSPORT"] = env
    c = make_case(world, "zigzag", True, n_local=8)
    q, k, v, _ = (shard(t, 1, rank, world) for t in global_inputs(c))
    with pytest.raises(ValueError, match=match) as err:
        ring_flash_attn_func(q, k, v, causal=True, transport=arg)
    return str(err.value)


@pytest.mark.parametrize(
    "env, arg, match",
    [
        ("nvlink", None, r"RINGFLASH_TRANSPORT must be one of \('nccl', 'copy-engine'\), got 'nvlink'"),
        (None, "nvlink", r"transport must be one of \('nccl', 'copy-engine'\) or None, got 'nvlink'"),
        ("copy-engine", None, "transport: copy-engine needs an NCCL group.*gloo"),
        ("nccl", "copy-engine", "transport: copy-engine needs an NCCL group.*gloo"),
    ],  # the argument wins
)
def test_transport_is_checked(env, arg, match):
    # Copy engines move CUDA blocks between the GPUs of one host (tested by the multigpu case);
    # a gloo group or an unknown name gets an error naming the argument or variable, on every rank.
    assert len(run_ranks(_transport_worker, 2, (env, arg, match))) == 2


def _error_worker(rank, world, what):
    c = make_case(world, "zigzag", True, n_local=8)
    q, k, v, _ = global_inputs(c)
    good = q, k, v = tuple(shard(t, 1, rank, world) for t in (q, k, v))
    kwargs = dict(causal=True)
    expect = "differ between the ranks"
    if what == "shape" and rank == 1:
        q, k, v = q[:, :4], k[:, :4], v[:, :4]
    elif what == "dtype" and rank == 2:
        q, k, v = q.half(), k.half(), v.half()
    elif what == "causal" and rank == 0:
        kwargs["causal"] = False
    elif what == "scale" and rank == 1:
        kwargs["softmax_scale"] = 0.5
    elif what == "layout" and rank == 1:
        kwargs["layout"] = "contiguous"
    elif what == "one_rank_bad_input":
        expect = "q must have 4 dims" if rank == 1 else r"rank\(s\) \[1\] of the group rejected"
        if rank == 1:
            q = q[0]
    elif what == "unsplittable":  # zigzag needs an even local length
        q, k, v = q[:, :5], k[:, :5], v[:, :5]
        expect = "5 local tokens.*multiple of"
    elif what == "bad_layout":
        kwargs["layout"] = "ring"
        expect = "layout must be one of"
    elif what == "bad_group":
        kwargs["group"] = "world"
        expect = "group must be"
    elif what == "one_rank_dropout":  # flash_attn's arguments are checked like ringflash's own
        expect = "dropout_p=0.5" if rank == 1 else r"rank\(s\) \[1\] of the group rejected"
        kwargs["dropout_p"] = 0.5 if rank == 1 else 0.0
    elif what == "one_rank_window_size":
        expect = r"window_size=\(3, 1\)" if rank == 2 else r"rank\(s\) \[2\] of the group rejected"
        kwargs["window_size"] = (3, 1) if rank == 2 else (3, 0)
    elif what == "one_rank_bad_packed_kv":  # refused before ring_flash_attn_func's own checks
        expect = r"kv must have shape \(batch" if rank == 1 else r"rank\(s\) \[1\] of the group rejected"
        kv = k if rank == 1 else torch.stack((k, v), dim=2)
        with pytest.raises(ValueError, match=expect) as err:
            ringflash.ring_flash_attn_kvpacked_func(q, kv, causal=True)
        ring_flash_attn_func(*good, causal=True)
        return str(err.value)
    with pytest.raises((ValueError, TypeError), match=expect) as err:
        ring_flash_attn_func(q, k, v, **kwargs)
    # Nothing was left in flight: the same group still runs a correct ring call.
    ring_flash_attn_func(*good, causal=True)
    return str(err.value)


@pytest.mark.parametrize(
    "what",
    [
        "shape",
        "dtype",
        "causal",
        "scale",
        "layout",
        "one_rank_bad_input",
        "unsplittable",
        "bad_layout",
        "bad_group",
        "one_rank_bad_packed_kv",
        "one_rank_dropout",
        "one_rank_window_size",
    ],
)
def test_errors_raise_on_every_rank(what):
    msgs = run_ranks(_error_worker, 3, (what,), timeout_s=20)
    assert len(msgs) == 3
    if what in ("shape", "dtype", "causal", "scale", "layout"):
        assert len(set(msgs)) == 1, "every rank reports the same mismatch"
        assert _named_ranks(msgs[0]) == {0, 1, 2}, msgs[0]


def _named_ranks(msg: str) -> set[int]:
    """The ranks a mismatch names: `... on rank 1`, `... on ranks 0, 2`, `... on ranks 0-2`."""
    named = set()
    for ranks in re.findall(r"on ranks? (\d+(?:-\d+)?(?:, \d+(?:-\d+)?)*)", msg):
        for part in ranks.split(", "):
            first, _, last = part.partition("-")
            named.update(range(int(first), int(last or first) + 1))
    return named


def _raises_on_rank_1(rank, world):
    if rank == 1:
        raise KeyError("from rank 1")
    return rank


def test_harness_reports_rank_tracebacks():
    with pytest.raises(RankFailure, match="from rank 1") as err:
        run_ranks(_raises_on_rank_1, 2)
    assert list(err.value.errors) == [1] and "KeyError" in err.value.errors[1], err.value


def _null_ring(rank, world, n_local=16, causal=True, layout="zigzag"):
    """The ring loop's arguments for rank `rank` of `world` with no communication (NullComm)."""
    return dict(
        plan=ring_schedule(rank, world, n_local, causal, layout),
        scale=0.25,
        kernels=backend_named("reference"),
        comm=ringflash.NullComm(rank, world),
    )


def test_null_comm_runs_the_same_schedule():
    # NullComm (the benchmark's compute-only ring) runs every step's kernels without sending.
    c = make_case(1, n_local=16)
    q, k, v, _ = global_inputs(c)
    o, lse, _ = ring_forward(q, k, v, **_null_ring(1, 4))
    assert o.shape == q.shape and lse.shape == (2, 4, 16) and torch.isfinite(o).all()


def test_pack_kv_is_k_then_v():
    _, k, v, _ = global_inputs(make_case(1, n_local=16))
    assert pack_kv(k, v).view(-1).equal(torch.stack((k, v)).view(-1))  # one block, the bytes of k then v
    v = v[..., :8].contiguous()  # a value head dim of its own
    assert all(a.equal(b) for a, b in zip(kv_views(pack_kv(k, v), k.shape[3]), (k, v)))


@pytest.mark.parametrize("world", [2, 3, 4, 5])
def test_forward_keeps_the_block_received_first(world):
    # What the backward takes for k and v: the previous rank's block, in the buffer step 1 received
    # it into (NullComm receives nothing: the buffer as it was), which no later step reuses.
    q, k, v, _ = global_inputs(make_case(1, n_local=16))
    kw = _null_ring(0, world)
    kept = ring_forward(q, k, v, **kw)[2]
    assert kept is kw["comm"].buffer("kv0", kept.shape, k.dtype, k.device)
    buf = _ring_buffers(pack_kv(k, v), kw["comm"], hold=True)
    assert buf(1) is kept and all(buf(s) is not kept for s in range(2, world))
    assert all(buf(s) is not buf(s + 1) for s in range(world - 1))  # a step never receives into its own block
    alone = ring_forward(q, k, v, **_null_ring(0, 1))[2]
    assert alone[0] is k and alone[1] is v


@pytest.mark.parametrize("world", [1, 2])
def test_results_are_contiguous_whatever_q_strides(world):
    # o and dq come back contiguous, as the ops' fake implementations promise torch.compile, even
    # when q is a dense non-contiguous view (a (B, H, N, D) tensor transposed).
    c = make_case(1, n_local=16)
    q, k, v, do = global_inputs(c)
    q = q.transpose(1, 2).contiguous().transpose(1, 2)
    kw = _null_ring(0, world)
    o, lse, kv = ring_forward(q, k, v, **kw)
    dq, dkv = ring_backward(do, q, kv, o, lse, **kw)
    assert not q.is_contiguous() and o.is_contiguous() and dq.is_contiguous() and dkv.is_contiguous()


# ---- GPU: several gloo ranks sharing one GPU, CUDA tensors, Triton kernels ---------------------------

GPU_CASES = [
    make_case(w, layout, causal, B=1, n_local=4000 // w, H=8, Hkv=2, D=128, dtype=dt, backend="triton", device="cuda")
    for w in (2, 4)
    for layout, causal, dt in (
        ("zigzag", True, torch.bfloat16),
        ("contiguous", True, torch.bfloat16),
        ("zigzag", False, torch.float16),
    )
] + [  # the ring on cuDNN's kernels (kernels/cudnn.py)
    make_case(w, "zigzag", True, B=1, n_local=4000 // w, H=8, Hkv=hkv, D=128, dtype=torch.bfloat16,
              backend="cudnn", device="cuda")
    for w, hkv in ((2, 8), (2, 2), (4, 2))  # W = 2: partial results in bf16; W = 4: float32 sums
] + [  # the Hopper kernels under the ring (kernels/hopper_fwd.py, hopper_bwd.py; Triton's elsewhere): merges
    # into float32 partials, float32 sums added atomically, ragged local lengths, a contiguous and a
    # zigzag layout, both head dims (two and three consumer warpgroups in the forward)
    make_case(w, layout, causal, B=1, n_local=4000 // w, H=8, Hkv=2, D=d, dtype=torch.bfloat16, backend="hopper",
              device="cuda")
    for w, layout, causal, d in ((2, "zigzag", True, 128), (4, "contiguous", True, 128), (2, "zigzag", False, 128),
                                 (4, "zigzag", True, 64))
] + [  # q, k, v as views of a fused QKV projection's output (descriptor loads with its strides)
    make_case(2, "zigzag", True, B=1, n_local=2000, H=8, Hkv=2, D=128, dtype=torch.bfloat16, backend="triton",
              device="cuda", strided=True)
] + [  # a value head dim of its own (DeepSeek's MLA): Triton's kernels, and hopper's fallback to them
    make_case(w, layout, True, B=1, n_local=4000 // w, H=8, Hkv=8, D=d, Dv=dv, dtype=torch.bfloat16, backend=b,
              device="cuda")
    for w, layout, d, dv, b in ((2, "zigzag", 192, 128, "triton"), (4, "contiguous", 128, 256, "triton"),
                                (2, "zigzag", 192, 128, "hopper"))
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=_case_id)
def test_ring_gpu_shared_by_gloo_ranks(case):
    # spawn, not fork: conftest has already asked CUDA whether it is available.
    run_ranks(ring_exactness_worker, case["world"], (case,), start_method="spawn", timeout_s=120)


@pytest.mark.multigpu
@pytest.mark.parametrize("backend", ["triton", "cudnn", "hopper"])
def test_ring_nccl_two_gpus(backend):
    # Two NCCL ranks, bf16, 64k tokens per rank, both transports: launch/check_ring_nccl.py.
    proc = torchrun(REPO / "launch" / "check_ring_nccl.py", "--backend", backend, timeout=900)
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-5000:]


@pytest.mark.multigpu
@pytest.mark.parametrize(
    "args",
    [("--scheme", "allgather"), ("--tokens-per-rank", "8192", "--scheme", "allgather", "--window-size", "3000,0"),
     ("--tokens-per-rank", "4096", "--softcap", "30", "--sink"),
     ("--tokens-per-rank", "4096", "--window-size", "700,300")],
)  # fmt: skip
def test_schemes_and_features_nccl_two_gpus(args):
    # The all-gather scheme, windows, softcapping and sinks over NCCL (launch/check_ring_nccl.py).
    # A window or a feature is checked against a naive reference, O(N²) memory a K/V head: 16k tokens.
    proc = torchrun(REPO / "launch" / "check_ring_nccl.py", *args, timeout=900)
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-5000:]


def test_ring_plan_must_have_every_step_and_compute_step_0():
    # A plan (e.g. a RingMask's) of the wrong length, or one skipping step 0 (which starts the
    # accumulators), is refused by name instead of failing inside the loop.
    q, k, v, do = global_inputs(make_case(1, n_local=8))
    kw = _null_ring(0, 2, n_local=8, causal=False, layout="contiguous")
    steps = kw.pop("plan")
    o, lse, kv = ring_forward(q, k, v, plan=steps, **kw)
    for plan in ([None, steps[1]], steps[:1], steps * 2):
        with pytest.raises(ValueError, match="a ring plan needs 2 steps, step 0 computed"):
            ring_forward(q, k, v, plan=plan, **kw)
        with pytest.raises(ValueError, match="a ring plan needs 2 steps, step 0 computed"):
            ring_backward(do, q, kv, o, lse, plan=plan, **kw)
