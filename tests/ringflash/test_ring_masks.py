"""Packed documents and sliding windows across the ring (ringflash/masks.py) equal float64 truth.

Every case builds the global q, k, v, do and document ids from a seed (the same on every rank),
computes float64 attention on the unsharded sequence under the explicit (B, N, N) mask (own
document only, causal, i − w < j <= i), runs the ring with `ring_mask(...)` on each rank's
shard, and compares o, lse, dq, dk, dv with the sharded truth (tests/truth.py's tolerances).
Every case also checks the skipping: the steps the mask skips are exactly those whose block
pair holds no visible (query, key) pair (a brute-force count on the dense mask), and they
launch no kernel (`attn_fwd` / `attn_bwd` calls counted in the ring module).

Documents have odd lengths (1, 3, 17, …) that cross shard and chunk boundaries; batch rows pack
different documents. CPU time: about 15 s (most of it the interpreted Triton case).
"""

from __future__ import annotations

import gc
import math
import re
import weakref

import pytest
import torch
import torch._dynamo
import torch.distributed as dist

import ringflash
from ringflash import global_positions, ring_flash_attn_func, ring_mask, shard
from ringflash.kernels import CAUSAL, AttnSpec, Backend, get_backend, interpreting
from ringflash.ring import ring_backward, ring_forward
from ringflash.transport import ring_comm
from tests.dist_utils import run_ranks
from tests.truth import TOL, lse_err, rel_err

N = 96  # global tokens: splits over 1–4 ranks under both layouts (a multiple of 2·3·4·2)
DOCS = {  # document lengths per batch row, summing to N
    "odd": [[1, 17, 40, 3, 35], [50, 1, 45]],
    "one": [[N], [N]],
    "many": [[5, 7, 1, 20, 11, 2, 17, 33], [33, 17, 2, 11, 20, 1, 7, 5]],
    "halves": [[48, 48], [48, 48]],  # boundaries on chunk edges: non-causal zigzag steps skip
    "gpu": [[1, 517, 1203, 33, 2246], [2999, 1001]],  # N_GPU tokens, real tile sizes
}
N_GPU = 4000


def doc_ids(name: str | None, B: int) -> torch.Tensor | None:
    if name is None:
        return None
    rows = [torch.repeat_interleave(torch.arange(len(ls)), torch.tensor(ls)) for ls in DOCS[name][:B]]
    return torch.stack(rows)


def allowed(doc, n, causal, window) -> torch.Tensor:
    """The dense mask `(B or 1, n, n)`: query i sees key j."""
    i = torch.arange(n)[:, None]
    j = torch.arange(n)[None, :]
    a = torch.ones(n, n, dtype=torch.bool)
    if causal:
        a &= j <= i
    if window is not None:
        a &= j > i - window
    a = a.unsqueeze(0)
    if doc is not None:
        a = a & (doc[:, :, None] == doc[:, None, :])
    return a


def masked_attention_f64(q, k, v, do, a, scale=None):
    """Float64 `softmax(QKᵀ·scale + mask)V` with autograd gradients; empty rows give o = 0, lse = −inf."""
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    H, Hkv = q.shape[2], k.shape[2]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    kr, vr = (t.repeat_interleave(H // Hkv, dim=2) for t in (k64, v64))
    s = torch.einsum("bqhd,bkhd->bhqk", q64, kr) * scale
    s = s.masked_fill(~a[:, None], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None].masked_fill(torch.isneginf(lse[..., None]), 0.0))
    o = torch.einsum("bhqk,bkhd->bqhd", p, vr)
    o.backward(do.double())
    return {"o": o.detach(), "lse": lse.detach(), "dq": q64.grad, "dk": k64.grad, "dv": v64.grad}


def brute_skipped(a, rank, world, layout) -> tuple[int, ...]:
    n = a.shape[1] // world
    pr = global_positions(n, rank, world, layout)
    out = []
    for s in range(1, world):
        pj = global_positions(n, (rank - s) % world, world, layout)
        if not a[:, pr][:, :, pj].any():
            out.append(s)
    return tuple(out)


def _err(x, ref):
    # A window of 1 (each token sees only itself) has dq = dk = 0 exactly: absolute error there.
    return rel_err(x, ref) if ref.norm() > 1e-9 else x.double().abs().max().item()


def case(world, layout="zigzag", causal=True, docs="odd", window=None, B=2, H=4, Hkv=2, D=16, dtype=torch.float32,
         backend="reference", n=N, seed=0, device="cpu"):  # fmt: skip
    return dict(world=world, layout=layout, causal=causal, docs=docs, window=window, B=B, H=H, Hkv=Hkv, D=D,
                dtype=dtype, backend=backend, n=n, seed=seed, device=device)  # fmt: skip


class _Counting(Backend):
    """Another backend's kernels, counting their launches."""

    def __init__(self, inner: Backend):
        self.inner, self.name, self.calls = inner, inner.name, {"fwd": 0, "bwd": 0}

    def partial_dtype(self, dtype):
        return self.inner.partial_dtype(dtype)

    def fwd_step(self, *args, **kwargs):
        self.calls["fwd"] += 1
        return self.inner.fwd_step(*args, **kwargs)

    def bwd_step(self, *args, **kwargs):
        self.calls["bwd"] += 1
        return self.inner.bwd_step(*args, **kwargs)


def mask_worker(rank, world, c):
    dev = torch.device(c["device"])
    if dev.type == "cuda":
        torch.cuda.set_device(0)  # every rank shares the one GPU (gloo stages through host memory)
    g = torch.Generator().manual_seed(c["seed"])
    B, n, L = c["B"], c["n"], c["layout"]
    shapes = [(B, n, c["H"], c["D"]), (B, n, c["Hkv"], c["D"]), (B, n, c["Hkv"], c["D"]), (B, n, c["H"], c["D"])]
    q, k, v, do = (torch.randn(s, generator=g).to(dev, c["dtype"]) for s in shapes)
    doc = doc_ids(c["docs"], B)
    a = allowed(doc, n, c["causal"], c["window"])
    truth = masked_attention_f64(q, k, v, do, a.to(dev))

    doc = None if doc is None else doc.to(dev)
    mask = ring_mask(doc, seqlen=n, layout=L, causal=c["causal"], window=c["window"])
    assert mask.skipped == brute_skipped(a, rank, world, L), (mask, brute_skipped(a, rank, world, L))

    ql, kl, vl = (shard(t, 1, rank, world, L).detach().clone().requires_grad_() for t in (q, k, v))
    # `window=` alone builds (and caches) the same mask inside the call.
    via = dict(causal=True, window_size=(c["window"] - 1, 0)) if c.get("via_window") else dict(mask=mask)
    o, lse, _ = ring_flash_attn_func(ql, kl, vl, layout=L, return_attn_probs=True, backend=c["backend"], **via)
    o.backward(shard(do, 1, rank, world, L))
    # The ring loop on the mask's steps, handed a counting backend: a skipped step launches nothing,
    # and the loop computes what the op did.
    kern = _Counting(get_backend(c["backend"], dev))
    plan, scale, comm = list(mask.steps), c["D"] ** -0.5, ring_comm(None)
    o2, lse2, kv = ring_forward(ql.detach(), kl.detach(), vl.detach(), plan, scale=scale, kernels=kern, comm=comm)
    ring_backward(shard(do, 1, rank, world, L), ql.detach(), kv, o2, lse2, plan, scale=scale, kernels=kern, comm=comm)
    want = world - len(mask.skipped)
    assert kern.calls == {"fwd": want, "bwd": want}, (kern.calls, mask)
    torch.testing.assert_close(o2, o.detach(), atol=0, rtol=0)

    got = {"o": o, "dq": ql.grad, "dk": kl.grad, "dv": vl.grad}
    assert all(x.dtype == c["dtype"] for x in got.values())
    errs = {name: _err(x, shard(truth[name], 1, rank, world, L)) for name, x in got.items()}
    errs["lse"] = lse_err(lse, shard(truth["lse"], 2, rank, world, L))
    tol = TOL[c["dtype"]]
    assert all(e < tol for name, e in errs.items() if name != "lse"), f"rank {rank}: {errs} exceed {tol}"
    assert errs["lse"] < 10 * tol, f"rank {rank}: lse error {errs['lse']}"
    return len(mask.skipped)


WINDOWS = ((4, "zigzag", 1), (4, "zigzag", 5), (3, "contiguous", 5), (2, "zigzag", 40), (4, "contiguous", 40),
           (2, "zigzag", 200))  # fmt: skip
CASES = [
    # documents, causal: 1–4 ranks, both layouts, MHA and GQA
    *(
        case(w, layout, docs="odd", Hkv=hkv)
        for w in (1, 2, 3, 4)
        for layout in ("zigzag", "contiguous")
        for hkv in ((2,) if w != 3 else (4, 1))
    ),
    case(4, "zigzag", docs="many"),
    # stripe: documents and windows over interleaved rows, every step a per-row interval mask
    *(case(w, "stripe", docs="odd", Hkv=2) for w in (1, 2, 3, 4)),
    case(4, "stripe", docs="many", window=5),
    case(3, "stripe", docs=None, window=13),
    case(2, "stripe", causal=False, docs="odd"),
    case(8, "zigzag", docs="many", window=40),  # 8 ranks, as on an 8-GPU node
    case(3, "zigzag", docs="many", B=1),
    # windows alone (1, 5, 40, >= N) and with documents
    *(case(w, layout, docs=None, window=win) for w, layout, win in WINDOWS),
    case(4, "zigzag", docs="odd", window=5),
    dict(case(3, "zigzag", docs=None, window=7), via_window=True),
    case(3, "contiguous", docs="many", window=13),
    # documents, not causal (a step's visible chunk pairs need not form a rectangle)
    case(2, "zigzag", causal=False, docs="halves"),
    case(4, "zigzag", causal=False, docs="odd"),
    case(3, "contiguous", causal=False, docs="many"),
    # low precision
    case(4, "zigzag", docs="odd", window=17, dtype=torch.bfloat16),
    case(2, "contiguous", docs="many", dtype=torch.float16),
]


def _id(c):
    parts = [f"w{c['world']}", c["layout"], "causal" if c["causal"] else "full", f"docs-{c['docs']}"]
    parts += [f"win{c['window']}"] if c["window"] else []
    parts += ["window-arg"] if c.get("via_window") else []
    return "-".join([*parts, f"h{c['H']}kv{c['Hkv']}", str(c["dtype"]).removeprefix("torch."), c["backend"]])


@pytest.mark.parametrize("c", CASES, ids=_id)
def test_ring_mask_matches_float64(c):
    run_ranks(mask_worker, c["world"], (c,))


def test_ring_mask_triton_kernels_interpreted():
    if not interpreting():
        pytest.skip("covered by the gpu tests")
    c = case(2, "zigzag", docs="odd", window=40, B=2, H=2, Hkv=1, D=32, dtype=torch.bfloat16, backend="triton")
    run_ranks(mask_worker, 2, (c,), timeout_s=120)


GPU_CASES = [  # on CUDA tensors, several gloo ranks sharing one GPU (as tests/ringflash/test_ring.py's)
    case(w, layout, docs="gpu", window=win, B=2, H=8, Hkv=2, D=128, dtype=torch.bfloat16, backend=backend,
         n=N_GPU, device="cuda")
    for w, layout, win in ((2, "zigzag", None), (2, "zigzag", 257), (4, "zigzag", 700), (2, "contiguous", 1500))
    for backend in ("triton", "hopper")  # hopper: its Gluon kernels on every step's intervals (sm_90)
]  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("c", GPU_CASES, ids=_id)
def test_ring_mask_gpu_shared_by_gloo_ranks(c):
    # spawn, not fork: conftest has already asked CUDA whether it is available.
    run_ranks(mask_worker, c["world"], (c,), start_method="spawn", timeout_s=120)


def test_windows_skip_steps():
    # A window of 5 on 4 zigzag ranks of 24 tokens (chunks of 12): only adjacent chunks are in
    # reach, so most off-diagonal steps are skipped, and fewer as the window shrinks to 1.
    skipped = run_ranks(mask_worker, 4, (case(4, "zigzag", docs=None, window=5),))
    assert sum(skipped) >= 4 * 3 - 4 * 2  # at most 2 off-diagonal steps per rank remain
    assert run_ranks(mask_worker, 4, (case(4, "zigzag", docs=None, window=1),)) == [3, 3, 3, 3]


def test_no_documents_no_window_is_the_plain_schedule():
    m = ringflash.masks._build(None, N, 1, 4, "zigzag", CAUSAL, torch.device("cpu"))
    steps = ringflash.layout.ring_schedule(1, 4, N // 4, True, "zigzag")
    assert list(m.steps) == steps
    assert all(s is None or s.spec.intervals is None for s in m.steps) and m.tensors == ()


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("layout", ringflash.LAYOUTS)
def test_one_document_per_row_is_the_plain_schedule(layout, causal):
    # Every visible rectangle is then wholly visible (or causal on the diagonal): the kernels get
    # the dense/causal flag, not a Visibility, on exactly the plain schedule's rows.
    doc = torch.zeros(2, N, dtype=torch.long)
    for rank in range(4):
        m = ringflash.masks._build(doc, N, rank, 4, layout, AttnSpec(causal=causal), torch.device("cpu"))
        steps = ringflash.layout.ring_schedule(rank, 4, N // 4, causal, layout)
        assert list(m.steps) == steps, f"rank {rank}: {m}"
        assert m.tensors == (), f"rank {rank}: a Visibility where the dense kernels suffice"


def test_ops_decode_a_live_mask_to_its_own_steps():
    # The ops see a mask only as ints and tensors (`op_args`). Rebuilding its steps from them on
    # every call, forward and backward in every layer, is host time: a live mask's own come back.
    from ringflash.masks import decode, op_args

    m = ringflash.masks._build(doc_ids("odd", 2), N, 1, 4, "zigzag", CAUSAL, torch.device("cpu"))
    vis, kwargs = op_args(m)
    assert len(vis) >= 4  # steps with intervals, the ones that cost most to rebuild
    assert all(a is b for a, b in zip(decode(kwargs["mask_plan"], vis), m.steps, strict=True))
    # Tensors of the same values that are not the mask's are decoded, into steps holding them.
    copies = [t.clone() for t in vis]
    fresh = decode(kwargs["mask_plan"], copies)
    held = [t for st in fresh if st is not None and st.spec.intervals is not None for t in st.spec.intervals]
    assert all(a is b for a, b in zip(held, copies, strict=True))
    assert [(st.q, st.kv) if st else None for st in fresh] == [(st.q, st.kv) if st else None for st in m.steps]
    # Finding masks must not keep them (and their device tensors) alive.
    gone = weakref.ref(m)
    del m, vis
    gc.collect()
    assert gone() is None


# ---- errors -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        (dict(doc_ids=torch.tensor([0, 1, 1, 0])), ValueError, "doc_ids must be non-decreasing"),
        (dict(doc_ids=torch.zeros(4)), TypeError, "doc_ids must be an integer tensor"),
        (dict(doc_ids=torch.zeros(2, 2, 4, dtype=torch.long)), ValueError, "doc_ids must have shape"),
        (dict(doc_ids=[0, 0, 1]), TypeError, "doc_ids must be a torch.Tensor"),
        (dict(doc_ids=None), ValueError, "seqlen"),
        (dict(doc_ids=torch.zeros(8, dtype=torch.long), seqlen=6), ValueError, "seqlen=6 disagrees"),
        (dict(doc_ids=None, seqlen=8, window=0), ValueError, "window must be a positive int"),
        (dict(doc_ids=None, seqlen=8, window=True), ValueError, "window must be a positive int"),
        (dict(doc_ids=None, seqlen=8, window=4, causal=False), ValueError, "window needs causal=True"),
        (dict(doc_ids=None, seqlen=8, layout="ring"), ValueError, "layout must be one of"),
        (dict(doc_ids=None, seqlen=8, causal=1), TypeError, "causal must be a bool"),
    ],
)
def test_ring_mask_bad_arguments(kwargs, exc, match):
    doc = kwargs.pop("doc_ids")
    with pytest.raises(exc, match=match):
        ring_mask(doc, **kwargs)


def test_call_disagreeing_with_the_mask():
    if dist.is_initialized():
        pytest.skip("a process group is live in this process; this test needs none")
    q = torch.randn(2, 8, 2, 16)
    m = ring_mask(torch.tensor([0, 0, 0, 1, 1, 1, 1, 1]), causal=True)
    with pytest.raises(ValueError, match="mask's causal is True, the call's False"):
        ring_flash_attn_func(q, q, q, causal=False, mask=m)
    with pytest.raises(ValueError, match="mask's local length is 8, the call's 4"):
        ring_flash_attn_func(q[:, :4], q[:, :4], q[:, :4], mask=m)
    with pytest.raises(ValueError, match=r"mask's window is None, the call's \(2, 0\)"):
        ring_flash_attn_func(q, q, q, mask=m, window_size=(2, 0))
    with pytest.raises(ValueError, match="mask's batch size is 2, the call's 3"):
        m2 = ring_mask(torch.zeros(2, 8, dtype=torch.long))
        ring_flash_attn_func(torch.randn(3, 8, 2, 16), torch.randn(3, 8, 2, 16), torch.randn(3, 8, 2, 16), mask=m2)
    with pytest.raises(TypeError, match=r"mask must be a ringflash\.RingMask"):
        ring_flash_attn_func(q, q, q, mask="docs")
    with pytest.raises(ValueError, match="mask's world size is 2, the call's 1; mask's rank is 1, the call's 0"):
        ring_flash_attn_func(q, q, q, mask=ringflash.masks._build(None, 16, 1, 2, "zigzag", CAUSAL, q.device))
    with pytest.raises(ValueError, match=r"mask's device is device\(type='meta'\), the call's device\(type='cpu'\)"):
        ring_flash_attn_func(q, q, q, mask=ring_mask(torch.tensor([0, 0, 0, 1, 1, 1, 1, 1]), device="meta"))


def test_window_arguments_are_checked():
    if dist.is_initialized():
        pytest.skip("a process group is live in this process; this test needs none")
    q = torch.randn(2, 8, 2, 16)
    renamed = re.escape(
        "window=3 is now window_size=(left, right), flash_attn's form (-1: no limit): a causal window of w keys is "
        "window_size=(w - 1, 0)"
    )
    with pytest.raises(TypeError, match=renamed):  # the old name, pointed at the new one
        ring_flash_attn_func(q, q, q, causal=True, window=3)
    with pytest.raises(TypeError, match=renamed):
        ringflash.RingFlashAttention(causal=True, window=3)
    with pytest.raises(ValueError, match=r"window_size=\(-2, 0\): entries must be >= 0"):
        ring_flash_attn_func(q, q, q, causal=True, window_size=(-2, 0))
    with pytest.raises(TypeError, match="window_size must be a pair of ints"):
        ring_flash_attn_func(q, q, q, causal=True, window_size=(True, 0))
    with pytest.raises(ValueError, match=r"window_size=\(2, 1\) with causal=True: a causal window has no keys"):
        ringflash.RingFlashAttention(causal=True, window_size=(2, 1))
    with pytest.raises(TypeError, match=r"window_size must be a pair of ints \(left, right\), got 3"):
        ringflash.RingFlashAttention(None, "zigzag", True, None, None, True, 3)  # the old positional window


def _mismatch_worker(rank, world, what):
    n = 16 * world
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, n, 2, 16, generator=g) for _ in range(3))
    ql, kl, vl = (shard(t, 1, rank, world) for t in (q, k, v))
    doc = torch.zeros(n, dtype=torch.long)
    kw = {}
    if what == "docs":
        doc[n // 2 + rank :] = 1  # every rank a different boundary
        kw["mask"] = ring_mask(doc)
        expect = "differ between the ranks of the group: the mask"
    elif what == "window":
        kw["window_size"] = (3, 0) if rank == 0 else (4, 0)
        expect = re.escape("window_size is (3, 0) on rank 0, (4, 0) on rank 1")
    elif what == "layout":
        kw["mask"] = ring_mask(doc, layout="contiguous" if rank == 1 else "zigzag")
        expect = "mask's layout is 'contiguous'" if rank == 1 else r"rank\(s\) \[1\] of the group rejected"
    with pytest.raises(ValueError, match=expect) as err:
        ring_flash_attn_func(ql, kl, vl, causal=True, **kw)
    # Nothing left in flight: the group still runs a masked call.
    ring_flash_attn_func(ql, kl, vl, causal=True, window_size=(2, 0))
    return str(err.value)


@pytest.mark.parametrize("what", ["docs", "window", "layout"])
def test_ranks_given_different_masks_raise(what):
    run_ranks(_mismatch_worker, 2, (what,), timeout_s=20)
