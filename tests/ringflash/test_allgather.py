"""All-gather context parallelism (ringflash/allgather.py) equals float64 truth on 1-4 gloo ranks.

Each case builds the global q, k, v, do, document ids and a learnable sink from a seed, computes
float64 attention on the unsharded sequence under the explicit mask (tests/ringflash/test_ring_masks.py's)
with the softcap and sink (tests/truth_features.py), runs `ring_flash_attn_func(..., scheme="allgather")`
on each rank's shard in every layout, and compares o, lse, dq, dk, dv (and the sink's gradient,
summed over the ranks) with the sharded truth. Head chunks of 1 and 2 K/V heads exercise the
gather pipeline (several chunks in flight) and the GQA head mapping.
"""

from __future__ import annotations

import itertools
import re

import pytest
import torch
import torch.distributed as dist

import ringflash
from ringflash import gather_mask, ring_flash_attn_func, ring_mask, shard
from ringflash.kernels import interpreting
from tests.dist_utils import run_ranks
from tests.ringflash.test_ring_masks import allowed, doc_ids
from tests.truth import TOL, lse_err, rel_err
from tests.truth_features import attention

N = 96
SOFTCAP = 1.5  # scores of these inputs reach ±3 and more: the cap bends them


def case(world, layout="zigzag", causal=True, docs=None, window=None, stride=1, B=2, H=4, Hkv=2, D=16,
         dtype=torch.float32, backend="reference", module=False, Dv=None, softcap=0.0, sink=False):  # fmt: skip
    return dict(world=world, layout=layout, causal=causal, docs=docs, window=window, stride=stride, B=B, H=H, Hkv=Hkv,
                D=D, dtype=dtype, backend=backend, module=module, Dv=Dv or D, softcap=softcap, sink=sink)  # fmt: skip


def worker(rank, world, c):
    g = torch.Generator().manual_seed(0)
    B, L = c["B"], c["layout"]
    shapes = [(B, N, c["H"], c["D"]), (B, N, c["Hkv"], c["D"]), (B, N, c["Hkv"], c["Dv"]), (B, N, c["H"], c["Dv"])]
    q, k, v, do = (torch.randn(s, generator=g).to(c["dtype"]) for s in shapes)
    sink = torch.randn(c["H"], generator=g) + 3.0 if c["sink"] else None  # near the rows' lse, so it matters
    doc = doc_ids(c["docs"], B)
    visible = allowed(doc, N, c["causal"], c["window"])[:, None]  # (B or 1, 1, N, N)
    truth = attention(q, k, v, visible=visible, softcap=c["softcap"], sink=sink, do=do)
    ql, kl, vl = (shard(t, 1, rank, world, L).detach().clone().requires_grad_() for t in (q, k, v))
    param = None if sink is None else torch.nn.Parameter(sink.clone())
    opts = dict(scheme="allgather", heads_k_stride=c["stride"], layout=L, backend=c["backend"], softcap=c["softcap"])
    if doc is not None:
        mask = gather_mask(doc, layout=L, causal=c["causal"], window=c["window"])
        assert mask.spec.intervals is not None
        opts["mask"] = mask
    else:
        opts["window_size"] = (c["window"] - 1, 0) if c["window"] else (-1, -1)
    if c["module"]:
        core = ringflash.RingFlashAttention(causal=c["causal"], **{k: v for k, v in opts.items() if k != "mask"})
        o = core(ql, kl, vl, mask=opts.get("mask"), learnable_sink=param)
        lse = None
    else:
        o, lse, _ = ring_flash_attn_func(ql, kl, vl, causal=c["causal"], return_attn_probs=True, learnable_sink=param,
                                         **opts)  # fmt: skip
    o.backward(shard(do, 1, rank, world, L))
    got = {"o": o, "dq": ql.grad, "dk": kl.grad, "dv": vl.grad}
    assert o.shape == (*ql.shape[:3], c["Dv"])
    assert all(x.dtype == c["dtype"] and x.shape == y.shape for x, y in zip(got.values(), (o, ql, kl, vl)))
    errs = {name: rel_err(x, shard(truth[name], 1, rank, world, L)) for name, x in got.items()}
    if lse is not None:
        assert lse.dtype == torch.float32 and lse.shape == (B, c["H"], N // world)
        errs["lse"] = lse_err(lse, shard(truth["lse"], 2, rank, world, L)) / 10
    if param is not None:  # each rank's gradient covers its own rows: summed, as a trainer reduces it
        dist.all_reduce(param.grad)
        errs["dsink"] = rel_err(param.grad, truth["dsink"])
    tol = TOL[c["dtype"]]
    assert all(e < tol for e in errs.values()), f"rank {rank}: {errs} exceed {tol}"
    if c["softcap"] or c["sink"]:  # the features move o far beyond the tolerance: none was ignored
        plain = attention(q, k, v, visible=visible)["o"]
        assert rel_err(o, shard(plain, 1, rank, world, L)) > 10 * tol
    return errs


CASES = [
    *(case(w, layout, causal) for w in (1, 2, 4) for layout in ringflash.LAYOUTS for causal in (False, True)),
    *(case(w, layout, docs="odd", stride=s) for w, s in ((2, 1), (3, 2)) for layout in ringflash.LAYOUTS),
    *(case(4, layout, docs="many", window=5) for layout in ringflash.LAYOUTS),
    case(3, "zigzag", window=13, Hkv=4, stride=3),  # a ragged last chunk
    case(4, "stripe", causal=False, docs="many", H=4, Hkv=1),  # MQA, documents without causality
    case(2, "zigzag", docs="odd", window=17, dtype=torch.bfloat16, module=True),
    # a value head dim of its own (DeepSeek's MLA), dense and with documents over head chunks
    case(4, "zigzag", D=24, Dv=16),
    case(3, "contiguous", causal=False, docs="odd", stride=2, D=8, Dv=24),
    # logit softcapping and a learnable sink, with and without documents and windows
    case(2, "zigzag", softcap=SOFTCAP, sink=True),
    case(2, "stripe", docs="odd", window=9, softcap=SOFTCAP),
    case(4, "contiguous", causal=False, docs="many", sink=True, stride=2),
    case(4, "zigzag", docs="many", window=5, softcap=SOFTCAP, sink=True, Hkv=1),
    case(2, "zigzag", docs="odd", window=17, dtype=torch.bfloat16, module=True, softcap=SOFTCAP, sink=True),
]


def _id(c):
    parts = [f"w{c['world']}", c["layout"], "causal" if c["causal"] else "full", f"docs-{c['docs']}"]
    parts += [f"win{c['window']}"] if c["window"] else []
    parts += [f"stride{c['stride']}", f"h{c['H']}kv{c['Hkv']}", str(c["dtype"]).removeprefix("torch.")]
    parts += [f"d{c['D']}v{c['Dv']}"] if c["Dv"] != c["D"] else []
    parts += [f"cap{c['softcap']:g}"] if c["softcap"] else []
    parts += ["sink"] if c["sink"] else []
    return "-".join(parts + (["module"] if c["module"] else []))


@pytest.mark.parametrize("c", CASES, ids=_id)
def test_allgather_matches_float64(c):
    run_ranks(worker, c["world"], (c,))


def test_allgather_triton_kernels_interpreted():
    if not interpreting():
        pytest.skip("covered by the gpu tests")
    run_ranks(worker, 2, (case(2, "stripe", docs="odd", B=1, H=2, Hkv=2, D=32, backend="triton"),))
    run_ranks(worker, 2, (case(2, "zigzag", B=1, H=2, Hkv=1, D=64, Dv=32, backend="triton"),))
    run_ranks(worker, 2, (case(2, "zigzag", docs="odd", window=9, B=1, H=2, Hkv=1, D=32, backend="triton",
                               softcap=SOFTCAP, sink=True),))  # fmt: skip


def test_allgather_equals_the_ring():
    # Same inputs, both schemes: the same attention and gradients (dq, dk, dv, the sink's) to float32
    # rounding, every layout, GQA, causal or not, with a window, with and without softcap and a sink.
    def fn(rank, world):
        g = torch.Generator().manual_seed(1)
        q, do = (torch.randn(1, 8, 4, 16, generator=g) for _ in range(2))
        k, v = (torch.randn(1, 8, 2, 16, generator=g) for _ in range(2))
        sink = torch.randn(4, generator=g) + 2.0
        calls = [dict(causal=True), dict(causal=False), dict(causal=True, window_size=(4, 0))]
        feats = ({}, dict(softcap=SOFTCAP), dict(softcap=SOFTCAP, learnable_sink=sink))
        for layout, call, features in itertools.product(ringflash.LAYOUTS, calls, feats):
            results = []
            for scheme in ("ring", "allgather"):
                x = [t.clone().requires_grad_() for t in (q, k, v)]
                s = features.get("learnable_sink")
                kw = dict(features, learnable_sink=None if s is None else s.clone().requires_grad_())
                o = ring_flash_attn_func(*x, layout=layout, scheme=scheme, **call, **kw)
                o.backward(do)
                sg = kw["learnable_sink"]
                results.append([o, *(t.grad for t in x)] + ([] if sg is None else [sg.grad]))
            for got, want in zip(*results):
                torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)

    run_ranks(fn, 3)


def _hybrid_worker(rank, world, u):
    # Head parallelism around the all-gather: u head ranks × world / u gather ranks, each head rank
    # with its heads' slice of the sink.
    ring_g, head_g = ringflash.hybrid_groups(u)
    ring_rank, head_rank = ringflash.grid_coords(rank, u)
    r = world // u
    for i, (layout, causal, docs, window, hkv, softcap, with_sink) in enumerate(
        [("zigzag", True, "odd", None, 2, SOFTCAP, True), ("stripe", True, None, 7, 1, 0.0, True),
         ("contiguous", False, "many", None, 4, 0.0, False)]
    ):  # fmt: skip
        g = torch.Generator().manual_seed(i)
        q, do = (torch.randn(2, N, 4, 16, generator=g) for _ in range(2))
        k, v = (torch.randn(2, N, hkv, 16, generator=g) for _ in range(2))
        sink = torch.nn.Parameter(torch.randn(4, generator=g) + 3.0) if with_sink else None
        doc = doc_ids(docs, 2)
        truth = attention(q, k, v, visible=allowed(doc, N, causal, window)[:, None], softcap=softcap, sink=sink, do=do)

        def sh(x, dim=1, layout=layout):
            return shard(x, dim, ring_rank, r, layout, head_rank=head_rank, head_world=u)

        ql, kl, vl = (sh(t).clone().requires_grad_() for t in (q, k, v))
        mask = None if doc is None else gather_mask(doc, group=ring_g, layout=layout, causal=causal)
        opts = dict(group=ring_g, head_group=head_g, layout=layout, window_size=(window - 1, 0) if window else (-1, -1),
                    mask=mask, scheme="allgather",
                    softcap=softcap, learnable_sink=sink)  # fmt: skip
        o, lse, _ = ring_flash_attn_func(ql, kl, vl, causal=causal, return_attn_probs=True, **opts)
        o.backward(sh(do))
        got = {"o": o, "dq": ql.grad, "dk": kl.grad, "dv": vl.grad}
        errs = {name: rel_err(x, sh(truth[name])) for name, x in got.items()}
        errs["lse"] = lse_err(lse, sh(truth["lse"], 2)) / 10
        if sink is not None:  # every grid rank's share: its heads' entries, its rows
            dist.all_reduce(sink.grad)
            errs["dsink"] = rel_err(sink.grad, truth["dsink"])
        assert all(e < TOL[torch.float32] for e in errs.values()), f"rank {rank} {layout}: {errs}"


def test_hybrid_head_parallel_allgather():
    run_ranks(_hybrid_worker, 4, (2,))


# ---- errors: raised on every rank, nothing hangs --------------------------------------------------


def _errors_worker(rank, world, what):
    q, k, v = (torch.randn(1, 8, 2, 16) for _ in range(3))
    kw = dict(causal=True, scheme="allgather")
    if what == "scheme" and rank == 1:
        kw["scheme"] = "ring"
    if what == "bad_stride" and rank == 1:
        kw["heads_k_stride"] = 0
    if what == "unknown_scheme" and rank == 0:
        kw["scheme"] = "tree"
    if what == "ring_mask":
        kw["mask"] = ring_mask(None, seqlen=8 * world, causal=True)
    if what == "head_group" and rank == 0:
        kw["head_group"] = dist.group.WORLD
    if what == "mask_layout":
        kw["mask"] = gather_mask(None, seqlen=8 * world, layout="contiguous" if rank else "zigzag")
    if what == "softcap" and rank == 1:
        kw["softcap"] = -1.0
    if what == "sink" and rank == 0:
        kw["learnable_sink"] = torch.zeros(3)
    if what == "sink_on_one_rank" and rank == 1:  # each rank's own call is fine: the agreement check names it
        kw["learnable_sink"] = torch.zeros(2)
    try:
        ring_flash_attn_func(q, k, v, **kw)
    except (TypeError, ValueError) as e:
        return str(e)
    return None


REJECTED = "rejected their inputs"


@pytest.mark.parametrize(
    "what,first,mine,others",
    [
        ("scheme", 0, "scheme is allgather on rank 0, ring on rank 1", "scheme is allgather on rank 0, ring on rank 1"),
        ("bad_stride", 1, "heads_k_stride must be a positive int", REJECTED),
        ("unknown_scheme", 0, r"scheme must be one of \('ring', 'allgather'\), got 'tree'", REJECTED),
        ("ring_mask", 0, "mask: scheme='allgather' takes a ringflash.GatherMask", "takes a ringflash.GatherMask"),
        ("head_group", 0, "group: with head_group= give the ring group explicitly", REJECTED),  # one rank's hybrid
        ("mask_layout", 1, "mask's layout is 'contiguous', the call's 'zigzag'", REJECTED),
        ("softcap", 1, r"softcap must be >= 0 and finite \(0.0: none\), got -1.0", REJECTED),
        ("sink", 0, r"learnable_sink must have shape \(H,\) = \(2,\), one logit per query head, got \(3,\)", REJECTED),
        ("sink_on_one_rank", 0, r"learnable_sink is None on rank 0, \(2,\) on rank 1", "learnable_sink is None"),
    ],
)
def test_errors_raise_on_every_rank(what, first, mine, others):
    msgs = run_ranks(_errors_worker, 2, (what,))
    assert re.search(mine, msgs[first] or ""), msgs
    assert re.search(others, msgs[1 - first] or ""), msgs


# ---- torch.compile: one custom op, no graph break ---------------------------------------------


def _compiled_worker(rank, world, masked):
    import torch._dynamo
    from torch._dynamo.testing import CompileCounterWithBackend

    from ringflash.train.config import ModelConfig
    from ringflash.train.model import Transformer

    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64))
    for block in model.blocks:
        block.attn.core = ringflash.RingFlashAttention(layout="stripe", causal=True, scheme="allgather")
    idx = torch.randint(0, 64, (2, 8 * world))
    x = shard(idx, 1, rank, world, "stripe")
    pos = ringflash.global_positions(x.shape[1], rank, world, "stripe")
    mask = None
    if masked:  # documents and a window: the intervals are op inputs
        doc = (torch.arange(8 * world) >= 5).long() + (torch.arange(8 * world) >= 11).long()
        mask = gather_mask(doc, layout="stripe", window=6)

    def step(m):
        m.zero_grad(set_to_none=True)
        loss = m(x, pos, mask=mask).float().square().mean()
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in m.parameters()]

    loss, grads = step(model)
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter, fullgraph=True)  # a graph break raises
    for _ in range(2):
        c_loss, c_grads = step(compiled)
        torch.testing.assert_close(c_loss, loss)
        for a, b in zip(c_grads, grads):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    assert counter.frame_count == 1
    return True


@pytest.mark.parametrize("masked", [False, True])
def test_compiled_transformer_matches_eager(masked):
    assert run_ranks(_compiled_worker, 2, args=(masked,), timeout_s=120) == [True, True]


def _opcheck_worker(rank, world, features):
    import ringflash.allgather_ops  # noqa: F401  (registers the ops)

    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 8, 4, 16, generator=g, requires_grad=True)
    k, v = (torch.randn(1, 8, 2, 16, generator=g, requires_grad=True) for _ in range(2))
    opts = dict(causal=True, softmax_scale=0.25, layout="zigzag", group_name="", backend=None, heads_k_stride=1,
                check_ranks=False)  # fmt: skip
    args = (q, k, v, [])
    if features:  # the sink's gradient in the autograd formula, the softcap in both ops
        args, opts = (*args, torch.randn(4, generator=g, requires_grad=True)), dict(opts, softcap=SOFTCAP)
    torch.library.opcheck(torch.ops.ringflash.allgather_attn.default, args, opts)


@pytest.mark.parametrize("features", [False, True], ids=["plain", "softcap-sink"])
def test_allgather_op_opcheck_one_rank(features):
    run_ranks(_opcheck_worker, 1, (features,), timeout_s=120)
