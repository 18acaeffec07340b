"""The attention kernels (Triton, and the PyTorch reference) against a float64 ground truth.

On CPU the Triton kernels run under TRITON_INTERPRET=1 (tests/conftest.py) on small shapes that
still cover every code path: ragged lengths, several key blocks per query block, the causal
diagonal, GQA, every supported head dim, fp16/bf16/fp32. The `gpu` tests repeat this at
realistic sizes on CUDA, with every output poisoned with NaN before the launch.
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from ringflash.kernels import attn_bwd, attn_fwd, get_backend, interpreting, tuning
from ringflash.kernels.launch_utils import tma_ok
from ringflash.kernels.tiles import heaviest_first
from tests.kernels.steps import bwd_step, fwd_step
from tests.truth import TOL, attention_f64, lse_err, rel_err

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (B, Nq, Nk, H, Hkv, D): odd lengths, GQA/MQA, every head dim at least once.
SHAPES = [
    (1, 97, 97, 2, 1, 32),
    (2, 128, 128, 4, 2, 64),
    (1, 77, 77, 3, 3, 96),
    (1, 64, 64, 2, 1, 128),
    (1, 45, 45, 1, 1, 256),
]
NONCAUSAL_SHAPES = [(1, 50, 113, 4, 2, 64), (2, 130, 33, 2, 1, 32)]


def _inputs(shape, dtype, device="cpu", seed=0):
    B, Nq, Nk, H, Hkv, D = shape
    g = torch.Generator(device="cpu").manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g).to(device=device, dtype=dtype)
    return mk(B, Nq, H, D), mk(B, Nk, Hkv, D), mk(B, Nk, Hkv, D), mk(B, Nq, H, D)


def _check_all(q, k, v, do, causal, backend, scale=None):
    truth = attention_f64(q, k, v, causal, scale, do=do)
    o, lse = attn_fwd(q, k, v, causal=causal, softmax_scale=scale, backend=backend)
    dq, dk, dv = attn_bwd(do, q, k, v, o, lse, causal=causal, softmax_scale=scale, backend=backend)
    tol = TOL[q.dtype]
    assert o.dtype == q.dtype and lse.dtype == torch.float32 and lse.shape == truth["lse"].shape
    assert dq.dtype == q.dtype and dk.shape == k.shape and dv.shape == v.shape
    errs = {"o": rel_err(o, truth["o"]), "dq": rel_err(dq, truth["dq"]), "dk": rel_err(dk, truth["dk"]),
            "dv": rel_err(dv, truth["dv"])}
    assert all(e < tol for e in errs.values()), f"{errs} exceed {tol}"
    assert lse_err(lse, truth["lse"]) < 10 * tol


@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_matches_float64(shape, causal, dtype, backend):
    q, k, v, do = _inputs(shape, dtype)
    _check_all(q, k, v, do, causal, backend)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("n", [128, 160, 200])  # 2, 3 and 4 key blocks of the interpreter's 64
def test_paired_causal_dkdv_under_wide_gqa(n, dtype):
    """8 query heads a K/V head: causal dK/dV programs take key blocks i and n-1-i
    (kernels/triton_bwd.py), the middle one alone where the count is odd."""
    q, k, v, do = _inputs((1, n, n, 8, 1, 64), dtype)
    _check_all(q, k, v, do, True, "triton")


@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", NONCAUSAL_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_nq_differs_from_nk(shape, dtype, backend):
    q, k, v, do = _inputs(shape, dtype, seed=1)
    _check_all(q, k, v, do, False, backend, scale=0.3)


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_any_strides(backend):
    """q, k, v as views into one packed `(B, N, 3, H, D)` tensor, as a fused QKV projection gives."""
    B, N, H, D = 2, 70, 4, 64
    qkv = torch.randn(B, N, 3, H, D, generator=torch.Generator().manual_seed(3))
    q, k, v = qkv.unbind(2)
    assert not q.is_contiguous()
    do = torch.randn(B, N, H, D).transpose(0, 1).contiguous().transpose(0, 1)  # batch-minor strides
    _check_all(q, k, v, do, True, backend)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_kernels_through_pointers(shape, causal, monkeypatch):
    """`RINGFLASH_TMA=0` (as on pre-Hopper GPUs, odd head dims, unaligned views): the kernels load
    their tiles through pointers instead of tensor descriptors, with the same result."""
    monkeypatch.setenv("RINGFLASH_TMA", "0")
    q, k, v, do = _inputs(shape, torch.bfloat16, seed=6)
    _check_all(q, k, v, do, causal, "triton")


def test_descriptor_eligibility(monkeypatch):
    """Which `(B, N, H, D)` tensors the kernels load through tensor descriptors (kernels/launch_utils.py)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # stands in for a Hopper GPU
    q = torch.randn(2, 64, 4, 64, dtype=torch.bfloat16)
    assert tma_ok(q)
    assert tma_ok(*torch.randn(2, 64, 3, 4, 64, dtype=torch.float16).unbind(2))  # a packed QKV's views
    assert tma_ok(q[:, 10:])  # a ring step's slice of the sequence
    assert not tma_ok(q.float())  # float32 keeps the pointer loads
    assert not tma_ok(torch.randn(1, 64, 2, 96, dtype=torch.bfloat16))  # D masked in its block
    assert not tma_ok(q.transpose(1, 2))  # heads not packed in the last two dims
    assert not tma_ok(torch.randn(1 + q.numel(), dtype=q.dtype)[1:].view(q.shape))  # 2-byte aligned
    assert not tma_ok(q[:, :0])  # no rows
    monkeypatch.setenv("RINGFLASH_TMA", "0")
    assert not tma_ok(q)


def _staged_kib(kernel: str, tile, head_dim: int) -> float:
    """Shared memory a tile's bf16 operands take: the resident ones plus `stages` of the streamed ones."""
    outer, inner, _, stages = tile
    resident = 1 if kernel == "fwd" else 2  # q; k, v (dK/dV); q, do (dQ)
    return (resident * outer + stages * 2 * inner) * head_dim * 2 / 1024


def test_tuned_tiles_fit_shared_memory(monkeypatch):
    """Descriptor tiles (Hopper) fit an H100's 227 KiB per block; pointer tiles, which run on
    older GPUs too, an A100's 163 KiB (kernels/tuning.py)."""
    monkeypatch.setattr(tuning, "interpreting", lambda: False)
    for kernel, head_dim in tuning.TUNED:
        for descriptors, limit in ((True, 227), (False, 163)):
            tile = tuning.tile_for(kernel, head_dim, descriptors)
            assert _staged_kib(kernel, tile, head_dim) <= limit, (kernel, head_dim, descriptors, tile)
    assert tuning.tile_for("fwd", 128, True) != tuning.tile_for("fwd", 128, False)  # the case that needs both
    for (kernel, head_dim), tile in tuning.GQA_TUNED.items():
        assert _staged_kib(kernel, tile, head_dim) <= 227, (kernel, head_dim, tile)
        assert tuning.tile_for(kernel, head_dim, True, group=tuning.GQA_MIN_GROUP) == tile
        tuned = tuning.TUNED[kernel, head_dim]
        assert tuning.tile_for(kernel, head_dim, True, group=tuning.GQA_MIN_GROUP // 2) == tuned
        assert tuning.tile_for(kernel, head_dim, False, group=tuning.GQA_MIN_GROUP) != tile  # measured with TMA only
        assert tuning.tile_for(kernel, head_dim, True, group=tuning.GQA_MIN_GROUP,
                               queries=tuning.GQA_MAX_QUERIES + 1) == tuned


@triton.jit
def _launch_order_kernel(OUT, n_sms):
    rank, bh = heaviest_first(n_sms)
    pid = tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
    tl.store(OUT + 2 * pid, rank)
    tl.store(OUT + 2 * pid + 1, bh)


@pytest.mark.slow
@pytest.mark.parametrize(
    "n_tiles, n_bh, n_sms, sweep",
    [(1, 1, 132, 1), (3, 1, 132, 1), (32, 16, 132, 4), (64, 16, 132, 2), (128, 16, 132, 1), (256, 4, 132, 1),
     (5, 7, 20, 4), (6, 9, 13, 2), (2, 3, 1000, 64)],
)
def test_launch_order_covers_the_grid_heaviest_first(n_tiles, n_bh, n_sms, sweep):
    """Every (tile, head) exactly once, the heads swept `sweep` at a time (the largest power of
    two whose tiles fit the SMs; fewer in the last sweep), each sweep's ranks heaviest first."""
    device = "cpu" if interpreting() else "cuda"
    out = torch.full((n_bh * n_tiles, 2), -1, dtype=torch.int32, device=device)
    _launch_order_kernel[(n_tiles, n_bh)](out, n_sms)
    order = [tuple(pair) for pair in out.tolist()]  # in launch order
    expected = []
    for first in range(0, n_bh, sweep):
        heads = range(first, min(first + sweep, n_bh))
        expected += [(rank, bh) for rank in range(n_tiles) for bh in heads]
    assert order == expected


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_backward_with_global_lse_sums_to_full_gradient(backend):
    """Split K/V in two, merge the halves' (o, lse), run each half's backward with the *merged*
    o and lse: the halves' dq sum, and their dk/dv concatenate, to the unsplit gradients.
    This is the property the ring backward rests on."""
    q, k, v, do = _inputs((2, 96, 96, 4, 2, 64), torch.float32, seed=4)
    cut = 41
    halves = [(k[:, :cut], v[:, :cut]), (k[:, cut:], v[:, cut:])]
    parts = [attn_fwd(q, kh, vh, backend=backend) for kh, vh in halves]
    (o1, l1), (o2, l2) = parts
    lse = torch.logaddexp(l1, l2)
    w1 = torch.exp(l1 - lse).transpose(1, 2).unsqueeze(-1)  # (B, N, H, 1)
    w2 = torch.exp(l2 - lse).transpose(1, 2).unsqueeze(-1)
    o = o1 * w1 + o2 * w2
    grads = [attn_bwd(do, q, kh, vh, o, lse, backend=backend) for kh, vh in halves]
    truth = attention_f64(q, k, v, False, do=do)
    assert rel_err(o, truth["o"]) < TOL[torch.float32]
    assert lse_err(lse, truth["lse"]) < 1e-5
    assert rel_err(grads[0][0] + grads[1][0], truth["dq"]) < TOL[torch.float32]
    assert rel_err(torch.cat([grads[0][1], grads[1][1]], 1), truth["dk"]) < TOL[torch.float32]
    assert rel_err(torch.cat([grads[0][2], grads[1][2]], 1), truth["dv"]) < TOL[torch.float32]


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_rows_with_no_visible_key(backend):
    """No keys: o = 0 and lse = -inf. Rows whose (global) lse is -inf get zero gradient, never NaN."""
    q, k, v, do = _inputs((1, 33, 0, 2, 2, 64), torch.float32)
    o, lse = attn_fwd(q, k, v, backend=backend)
    assert torch.equal(o, torch.zeros_like(o)) and torch.isneginf(lse).all()

    q, k, v, do = _inputs((1, 50, 50, 2, 1, 32), torch.float32, seed=5)
    o, lse = attn_fwd(q, k, v, causal=True, backend=backend)
    lse = lse.clone()
    lse[:, :, 7:19] = float("-inf")
    dq, dk, dv = attn_bwd(do, q, k, v, o, lse, causal=True, backend=backend)
    assert all(torch.isfinite(t).all() for t in (dq, dk, dv))
    assert torch.equal(dq[:, 7:19], torch.zeros_like(dq[:, 7:19]))


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_float32_outputs_for_accumulation(backend):
    """out_dtype / grad_dtype=float32 (what the ring asks for) skip the final rounding to bf16."""
    q, k, v, do = _inputs((1, 40, 40, 2, 2, 32), torch.bfloat16)
    truth = attention_f64(q, k, v, True, do=do)
    o32, lse = fwd_step(q, k, v, causal=True, out_dtype=torch.float32, backend=backend)
    o16, _ = attn_fwd(q, k, v, causal=True, backend=backend)
    assert o32.dtype == torch.float32 and o16.dtype == torch.bfloat16
    assert rel_err(o32, truth["o"]) < rel_err(o16, truth["o"])
    grads = bwd_step(do, q, k, v, o16, lse, causal=True, grad_dtype=torch.float32, backend=backend)
    assert all(g.dtype == torch.float32 for g in grads)


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_kernels_build_no_autograd_graph(backend):
    """Plain tensors out on either backend: code that works on CPU must not rely on a graph the
    Triton path never builds (autograd goes through the ops, kernels/ops.py)."""
    q, k, v, do = (torch.randn(1, 32, 2, 16, dtype=torch.float16, requires_grad=True) for _ in range(4))
    o, lse = attn_fwd(q, k, v, causal=True, backend=backend)
    grads = attn_bwd(do, q, k, v, o, lse, causal=True, backend=backend)
    assert not any(t.requires_grad for t in (o, lse, *grads))
    assert torch.ops.ringflash.attn_fwd.default is not None  # registered by `import kernels`


def test_dispatcher(monkeypatch):
    cpu = torch.device("cpu")
    assert get_backend(None, cpu).name == "reference"
    assert get_backend("triton", cpu).name == "triton"  # allowed: the interpreter is on in tests
    monkeypatch.setenv("RINGFLASH_KERNEL_BACKEND", "triton")
    assert get_backend(None, cpu).name == "triton"
    with pytest.raises(ValueError, match=r"^backend must be one of"):
        get_backend("flash", cpu)
    with pytest.raises(ValueError, match=r"^backend='cudnn' needs CUDA tensors"):
        get_backend("cudnn", cpu)
    monkeypatch.setenv("RINGFLASH_KERNEL_BACKEND", "flash")  # the variable is named, not `backend`
    with pytest.raises(ValueError, match=r"^RINGFLASH_KERNEL_BACKEND must be one of"):
        get_backend(None, cpu)
    monkeypatch.setenv("RINGFLASH_KERNEL_BACKEND", "cudnn")
    with pytest.raises(ValueError, match=r"^RINGFLASH_KERNEL_BACKEND='cudnn' needs CUDA tensors"):
        get_backend(None, cpu)
    monkeypatch.setenv("RINGFLASH_KERNEL_BACKEND", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        get_backend("triton", cpu)


@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize(
    ("make", "exc", "match"),
    [
        (lambda q, k, v: (q[0], k, v), ValueError, "q must have 4 dims"),
        (lambda q, k, v: (q, k.half(), v), TypeError, "k.dtype must equal q.dtype"),
        (lambda q, k, v: (q.long(), k, v), TypeError, "q must be float16, bfloat16 or float32"),
        (lambda q, k, v: (q, k[..., :16], v[..., :16]), ValueError, "head_dim"),
        (lambda q, k, v: (q, torch.randn(2, 8, 3, 32), torch.randn(2, 8, 3, 32)), ValueError,
         "multiple of the number of key/value heads"),
        (lambda q, k, v: (q, k, v[:, :5]), ValueError, r"v.shape\[:3\] \(batch, seqlen, heads\) must equal k's"),
        (lambda q, k, v: (q, k[:1], v[:1]), ValueError, "batch"),
        (lambda q, k, v: (q, k[:, :5], v[:, :5]), ValueError, "causal=True needs as many queries"),
        (lambda q, k, v: (q.transpose(2, 3), k, v), ValueError, "contiguous last dim|4 dims|head_dim"),
        # q's shape, but a last-dim stride of 4: the kernels would read the wrong elements
        (lambda q, k, v: (torch.randn(2, 8, 32, 4).transpose(2, 3), k, v), ValueError,
         r"q must have a contiguous last dim \(stride 1\), got strides \(1024, 128, 1, 4\)"),
        (lambda q, k, v: (q, k.to("meta"), v.to("meta")), ValueError, "k must be on q's device"),
        # one past the largest head dim
        (lambda q, k, v: tuple(torch.randn(2, 8, h, 257) for h in (4, 2, 2)),
         ValueError, r"head_dim must be in \[1, 256\], got 257"),
        (lambda q, k, v: (q, k, torch.randn(2, 8, 2, 257)), ValueError,
         r"v.shape\[3\] \(value head_dim\) must be in \[1, 256\], got 257"),
    ],
)
def test_bad_input_names_the_argument(make, exc, match, backend):
    q, k, v, _ = _inputs((2, 8, 8, 4, 2, 32), torch.float32)
    q, k, v = make(q, k, v)
    with pytest.raises(exc, match=match):
        attn_fwd(q, k, v, causal=True, backend=backend)


def test_bad_backward_input():
    q, k, v, do = _inputs((1, 8, 8, 2, 2, 32), torch.float32)
    o, lse = attn_fwd(q, k, v)
    with pytest.raises(TypeError, match="lse must be float32"):
        attn_bwd(do, q, k, v, o, lse.half())
    with pytest.raises(ValueError, match="lse must have shape"):
        attn_bwd(do, q, k, v, o, lse[:, :1])
    with pytest.raises(ValueError, match=r"do must have shape \(B, Nq, H, Dv\) = \(1, 8, 2, 32\)"):
        attn_bwd(do[:, :4], q, k, v, o, lse)
    with pytest.raises(ValueError, match=r"o must have shape \(B, Nq, H, Dv\)"):
        attn_bwd(do, q, k, v, o[:, :4], lse)
    with pytest.raises(ValueError, match="do must have a contiguous last dim"):
        attn_bwd(torch.randn(1, 8, 32, 2).transpose(2, 3), q, k, v, o, lse)
    for scale in (-1.0, 0.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="softmax_scale must be a positive finite number"):
            attn_fwd(q, k, v, softmax_scale=scale)


def test_reference_backward_takes_o_as_given():
    """delta = rowsum(do·o) from the o passed in (here float32, unrounded, next to bf16 inputs),
    as the Triton preprocess does: not from o rounded to q's dtype first. (Reference only: the
    Triton kernels round P to bf16, which hides a rounding of o at this size.)"""
    q, k, v, do = _inputs((1, 40, 40, 4, 2, 32), torch.bfloat16, seed=10)
    truth = attention_f64(q, k, v, True, do=do)
    o, lse = truth["o"].float(), truth["lse"].float()
    grads = bwd_step(do, q, k, v, o, lse, causal=True, grad_dtype=torch.float32, backend="reference")
    errs = [rel_err(g, truth[n]) for g, n in zip(grads, ("dq", "dk", "dv"))]
    assert all(e < TOL[torch.float32] for e in errs), errs


# ---------------------------------------------------------------------------------------------
# GPU: realistic sizes, outputs poisoned with NaN so an element the kernel never writes fails.


@pytest.fixture
def poisoned_outputs(monkeypatch):
    """Make the launchers' `torch.empty` return NaN-filled float tensors."""
    import ringflash.kernels.triton_bwd as bwd_mod
    import ringflash.kernels.triton_fwd as fwd_mod

    real_empty = torch.empty

    def nan_empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    class PoisonedTorch:
        def __getattr__(self, name):
            return nan_empty if name == "empty" else getattr(torch, name)

        empty_like = staticmethod(lambda t, **kw: nan_empty(t.shape, dtype=kw.get("dtype", t.dtype),
                                                            device=t.device))

    monkeypatch.setattr(fwd_mod, "torch", PoisonedTorch())
    monkeypatch.setattr(bwd_mod, "torch", PoisonedTorch())


GPU_SHAPES = [
    (2, 1024, 1024, 16, 16, 128),
    (1, 4096, 4096, 8, 2, 64),
    (1, 2049, 2049, 4, 1, 96),
    (1, 1000, 3001, 4, 2, 32),
    (1, 1536, 1536, 4, 4, 256),
    (1, 16384, 16384, 2, 1, 128),
    (1, 1950, 1950, 8, 1, 64),  # 8 query heads a K/V head: dK/dV's GQA tile, paired programs, 31 key blocks
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_gpu_matches_float64(shape, causal, dtype, poisoned_outputs):
    if causal and shape[1] != shape[2]:
        pytest.skip("causal needs Nq == Nk")
    q, k, v, do = _inputs(shape, dtype, device="cuda", seed=7)
    _check_all(q, k, v, do, causal, "triton")


@pytest.mark.gpu
@pytest.mark.parametrize("shape", GPU_SHAPES[:2], ids=lambda s: "x".join(map(str, s)))
def test_gpu_kernels_through_pointers(shape, monkeypatch, poisoned_outputs):
    """The pointer-load kernels (pre-Hopper GPUs, `RINGFLASH_TMA=0`) on CUDA as well."""
    monkeypatch.setenv("RINGFLASH_TMA", "0")
    q, k, v, do = _inputs(shape, torch.bfloat16, device="cuda", seed=9)
    _check_all(q, k, v, do, True, "triton")


@pytest.mark.gpu
def test_gpu_float32_and_global_lse(poisoned_outputs):
    q, k, v, do = _inputs((1, 1000, 1000, 4, 2, 64), torch.float32, device="cuda", seed=8)
    _check_all(q, k, v, do, True, "triton")
