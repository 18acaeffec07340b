"""`backend="hopper"`: the Gluon forward (kernels/hopper_fwd.py) and the one-kernel backward with dQ
added atomically (kernels/hopper_bwd.py).

On an H100/H200 (`-m gpu`): o, lse and the gradients against float64, no further from it than the
Triton kernels' on the same inputs, over ragged lengths, GQA, both head dims, fp16 and bf16; the
ring-step arguments (forward: float32 partials, merges into an accumulator, `out=`; backward:
`out=`, `accumulate=`, `acc=`, `after_dkdv`); dK and dV reproducible. On CPU:
which cases fall back to the Triton kernels and why, and the refusals. The kernels' sm_90 compile
(ptxas, no GPU) is checked by tests/launch/test_kernel_report.py.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from ringflash import ring_flash_attn_func
from ringflash.kernels import AttnSpec, attn_bwd, attn_fwd, backends, get_backend, hopper_bwd
from ringflash.kernels.hopper_bwd import hopper_attn_bwd, hopper_bwd_unsupported
from ringflash.kernels.hopper_fwd import hopper_attn_fwd, hopper_fwd_unsupported
from tests.kernels.steps import bwd_step
from tests.truth import TOL, attention_f64, rel_err

sm90 = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                          reason="the Hopper kernels need an sm_90 GPU")


def _inputs(B, Nq, Nk, H, Hkv, D, dtype, device="cuda", seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g).to(device, dtype)
    return mk(B, Nq, H, D), mk(B, Nk, Hkv, D), mk(B, Nk, Hkv, D), mk(B, Nq, H, D)


SHAPES = [  # (B, Nq, Nk, H, Hkv, D)
    (2, 1024, 1024, 16, 16, 128),
    (1, 4096, 4096, 8, 2, 64),
    (1, 1000, 1000, 4, 4, 128),  # ragged: the last query and key blocks are partial
    (2, 1001, 1001, 2, 2, 128),  # an odd length: no head's rows start 16-byte aligned
    (1, 1950, 1950, 8, 1, 64),  # 8 query heads a K/V head, 16 key blocks
    (1, 1000, 3001, 4, 2, 64),  # a ring step's rectangle (full only): more keys than queries
    (2, 300, 77, 4, 1, 128),  # fewer keys than one key block
]


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_as_close_to_float64_as_the_deterministic_kernels(shape, causal, dtype):
    if causal and shape[1] != shape[2]:
        pytest.skip("causal needs Nq == Nk")
    q, k, v, do = _inputs(*shape, dtype, seed=7)
    truth = attention_f64(q, k, v, causal, do=do)
    o, lse = attn_fwd(q, k, v, causal=causal)
    spec = AttnSpec(causal=causal)
    assert hopper_bwd_unsupported(q, k, v, spec) is None
    got = hopper_attn_bwd(do, q, k, v, o, lse, spec)  # called directly: a fallback cannot pass for it
    ref = attn_bwd(do, q, k, v, o, lse, causal=causal, backend="triton")
    for name, g, r in zip(("dq", "dk", "dv"), got, ref):
        assert g.dtype == dtype and g.shape == r.shape
        err, base = rel_err(g, truth[name]), rel_err(r, truth[name])
        assert err < TOL[dtype] and err <= 1.25 * base + 1e-5, f"{name}: {err:.2e} against Triton's {base:.2e}"


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_forward_as_close_to_float64_as_the_triton_kernel(shape, causal, dtype):
    if causal and shape[1] != shape[2]:
        pytest.skip("causal needs Nq == Nk")
    q, k, v, _ = _inputs(*shape, dtype, seed=8)
    truth = attention_f64(q, k, v, causal)
    spec = AttnSpec(causal=causal)
    assert hopper_fwd_unsupported(q, k, v, spec) is None
    o, lse = hopper_attn_fwd(q, k, v, spec)  # called directly: a fallback cannot pass for it
    o_ref, lse_ref = attn_fwd(q, k, v, causal=causal, backend="triton")
    assert o.dtype == dtype and o.is_contiguous() and lse.shape == lse_ref.shape
    err, base = rel_err(o, truth["o"]), rel_err(o_ref, truth["o"])
    assert err < TOL[dtype] and err <= 1.25 * base + 1e-5, f"o: {err:.2e} against Triton's {base:.2e}"
    assert (lse.double() - truth["lse"]).abs().max() < 1e-3


def _fwd_steps(backend, q, blocks, rows, last_out=None):
    """A ring's forward steps through `backend`'s `fwd_step`: the first key block's float32 partials
    over all rows, then each later block merged into the accumulator's `rows` (views, as the ring
    passes them); the last merge writes o to `last_out` if given (the accumulator then only read)."""
    (k, v), *rest = blocks
    o, lse = backend.fwd_step(q, k, v, AttnSpec(), None, out_dtype=torch.float32)
    assert o.dtype == torch.float32
    for i, (k, v) in enumerate(rest):
        out = last_out if i == len(rest) - 1 else None
        ret = backend.fwd_step(q[:, rows], k, v, AttnSpec(), None, acc=(o[:, rows], lse[:, :, rows]),
                               out=None if out is None else out[:, rows])
        assert ret[1].data_ptr() == lse[:, :, rows].data_ptr()
    return o, lse


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("shape", [(2, 500, 4, 2, 128), (1, 777, 8, 8, 64)], ids=lambda s: "x".join(map(str, s)))
def test_forward_ring_steps(shape):
    # The Gluon forward's pointer-store epilogue: float32 partials, merges into a running float32
    # accumulator through views of it (rows 100:400, as a ring's later steps pass them), the last
    # merge's o rounded into a view of a larger buffer; against float64 over all the keys, as
    # close as the Triton kernel doing the same steps.
    B, N, H, Hkv, D = shape
    q, k1, v1, _ = _inputs(B, N, N + 200, H, Hkv, D, torch.bfloat16, seed=9)
    _, k2, v2, _ = _inputs(B, N, 300, H, Hkv, D, torch.bfloat16, seed=10)
    assert hopper_fwd_unsupported(q, k1, v1, AttnSpec()) is None
    rows = slice(100, 400)
    truth = attention_f64(q[:, rows], torch.cat([k1, k2], 1), torch.cat([v1, v2], 1), False)
    results = {}
    for name in ("hopper", "triton"):
        backend = get_backend(name, q.device)
        o, lse = _fwd_steps(backend, q, [(k1, v1), (k2, v2)], rows)
        big = torch.zeros(B, N, H, 2 * D, device="cuda", dtype=torch.bfloat16)
        o_read, lse2 = _fwd_steps(backend, q, [(k1, v1), (k2, v2)], rows, last_out=big[..., :D])
        results[name] = (o[:, rows], big[:, rows, :, :D])
        # With out=, the accumulator is only read (step 0's partials stay) and lse is merged; nothing
        # else in big is written.
        assert torch.equal(o_read, backend.fwd_step(q, k1, v1, AttnSpec(), None, out_dtype=torch.float32)[0])
        assert torch.equal(lse2, lse) and (big[..., D:] == 0).all()
        assert (big[:, :100] == 0).all() and (big[:, 400:] == 0).all()
        assert (lse[:, :, rows].double() - truth["lse"]).abs().max() < 1e-3
    for i, name in enumerate(("o", "o rounded")):
        err, base = rel_err(results["hopper"][i], truth["o"]), rel_err(results["triton"][i], truth["o"])
        assert err < TOL[torch.bfloat16] and err <= 1.25 * base + 1e-5, f"{name}: {err:.2e} against Triton's {base:.2e}"
    # A causal first step's float32 partials, and o written through a view by pointer stores.
    truth = attention_f64(q, k1[:, :N], v1[:, :N], True)
    big = torch.zeros(B, N, H, 2 * D, device="cuda", dtype=torch.bfloat16)
    o, lse = hopper_attn_fwd(q, k1[:, :N], v1[:, :N], AttnSpec(causal=True), out=big[..., D:])
    assert o.data_ptr() == big[..., D:].data_ptr() and rel_err(o, truth["o"]) < TOL[torch.bfloat16]
    assert (big[..., :D] == 0).all()
    o, lse = hopper_attn_fwd(q, k1[:, :N], v1[:, :N], AttnSpec(causal=True), out_dtype=torch.float32)
    o_ref, _ = get_backend("triton", q.device).fwd_step(q, k1[:, :N], v1[:, :N], AttnSpec(causal=True), None,
                                                        out_dtype=torch.float32)
    assert o.dtype == torch.float32 and rel_err(o, truth["o"]) <= 1.25 * rel_err(o_ref, truth["o"]) + 1e-6
    assert (lse.double() - truth["lse"]).abs().max() < 1e-3


@pytest.mark.gpu
@sm90
def test_dk_dv_reproducible_and_dq_within_rounding():
    q, k, v, do = _inputs(1, 2048, 2048, 8, 2, 128, torch.bfloat16, seed=3)
    o, lse = attn_fwd(q, k, v, causal=True)
    runs = [hopper_attn_bwd(do, q, k, v, o, lse, AttnSpec(causal=True), grad_dtype=torch.float32) for _ in range(3)]
    for dq, dk, dv in runs[1:]:
        assert torch.equal(dk, runs[0][1]) and torch.equal(dv, runs[0][2])
        assert rel_err(dq, runs[0][0]) < 1e-6  # float32 sums in another order


@pytest.mark.gpu
@sm90
def test_views_of_a_packed_qkv_and_a_scale():
    B, N, H, D = 2, 333, 4, 64
    qkv = torch.randn(B, N, 3, H, D, device="cuda", dtype=torch.bfloat16)
    q, k, v = qkv.unbind(2)
    do = torch.randn_like(q)
    truth = attention_f64(q, k, v, True, scale=0.2, do=do)
    o, lse = attn_fwd(q, k, v, causal=True, softmax_scale=0.2)
    grads = hopper_attn_bwd(do, q, k, v, o, lse, AttnSpec(causal=True), 0.2)
    for name, got in zip(("dq", "dk", "dv"), grads):
        assert rel_err(got, truth[name]) < TOL[torch.bfloat16], name


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("sums_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_ring_step_contract(sums_dtype):
    # The step API's sums: float32 running sums added to in place (dQ summed atomically straight
    # into out's dq), or sums only read and the totals written rounded; after_dkdv runs once,
    # after dK and dV are final.
    q, k, v, do = _inputs(2, 300, 500, 4, 2, 128, torch.bfloat16, seed=5)
    assert hopper_bwd_unsupported(q, k, v, AttnSpec()) is None  # not a fallback to the Triton kernels
    o, lse = attn_fwd(q, k, v)
    grads = bwd_step(do, q, k, v, o, lse, grad_dtype=torch.float32, backend="triton")
    gen = torch.Generator().manual_seed(6)
    sums = tuple(torch.randn(g.shape, generator=gen).cuda().to(sums_dtype) for g in grads)
    before = tuple(s.clone() for s in sums)
    seen = []

    def hook():
        torch.cuda.synchronize()
        seen.append(tuple(t.clone() for t in totals[1:]))  # dK and dV as they are when it runs

    if sums_dtype == torch.float32:
        totals = sums
        ret = bwd_step(do, q, k, v, o, lse, grad_dtype=torch.float32, out=sums, accumulate=True, after_dkdv=hook,
                       backend="hopper")
        assert all(r is s for r, s in zip(ret, sums))
    else:
        totals = tuple(torch.full_like(t, 7.0) for t in (q, k, v))
        ret = bwd_step(do, q, k, v, o, lse, out=totals, acc=sums, after_dkdv=hook, backend="hopper")
        assert all(r is t for r, t in zip(ret, totals))
        assert all(torch.equal(s, b) for s, b in zip(sums, before))  # acc is read, never written
    assert len(seen) == 1 and all(torch.equal(a, b) for a, b in zip(seen[0], totals[1:]))
    for got, b, g in zip(totals, before, grads):
        assert rel_err(got, b.float() + g) < (1e-5 if sums_dtype == torch.float32 else TOL[torch.bfloat16])


def test_falls_back_where_it_does_not_run():
    # Where the Gluon kernels do not run (here: CPU tensors, float32, a window) the backend is the
    # Triton one, bit for bit; and the backward does not under torch.use_deterministic_algorithms.
    q, k, v, do = _inputs(1, 70, 70, 2, 1, 64, torch.float32, device="cpu", seed=1)
    assert "sm_90" in hopper_bwd_unsupported(q, k, v, AttnSpec(causal=True))
    assert "sm_90" in hopper_fwd_unsupported(q, k, v, AttnSpec(causal=True))
    o, lse = attn_fwd(q, k, v, causal=True, window_size=(19, 0), backend="hopper")
    got = attn_bwd(do, q, k, v, o, lse, causal=True, window_size=(19, 0), backend="hopper")
    ref = attn_bwd(do, q, k, v, o, lse, causal=True, window_size=(19, 0), backend="triton")
    assert all(torch.equal(a, b) for a, b in zip(got, ref))
    assert not get_backend("hopper", q.device).deterministic
    torch.use_deterministic_algorithms(True)
    try:
        assert "use_deterministic_algorithms" in hopper_bwd_unsupported(q, k, v, AttnSpec(causal=True))
    finally:
        torch.use_deterministic_algorithms(False)


def test_refuses_what_the_triton_kernels_refuse():
    # Checked before the device is: causal over a rectangle, an out= of another shape.
    q, k, v, do = _inputs(1, 40, 60, 2, 1, 64, torch.bfloat16, device="cpu")
    with pytest.raises(ValueError, match="causal=True needs as many queries as keys"):
        hopper_attn_fwd(q, k, v, AttnSpec(causal=True))
    o, lse = attn_fwd(q, k, v, backend="reference")
    with pytest.raises(ValueError, match="causal=True needs as many queries as keys"):
        hopper_attn_bwd(do, q, k, v, o, lse, AttnSpec(causal=True))
    with pytest.raises(ValueError, match=r"out must have shape \(B, Nq, H, Dv\)"):
        hopper_attn_fwd(q, k, v, AttnSpec(), out=torch.empty(1, 41, 2, 64, dtype=torch.bfloat16))


@pytest.mark.gpu
@sm90
def test_what_it_does_not_run_is_named():
    q, k, v, _ = _inputs(1, 128, 128, 2, 2, 96, torch.bfloat16)
    assert "head dim in (64, 128), got 96" in hopper_bwd_unsupported(q, k, v, AttnSpec(causal=True))
    assert "float32" in hopper_bwd_unsupported(q.float(), k.float(), v.float(), AttnSpec(causal=True))
    q, k, v, do = _inputs(1, 128, 128, 2, 2, 64, torch.bfloat16)
    assert hopper_bwd_unsupported(q, k, v, AttnSpec(causal=True, softcap=30.0)) is None
    o, lse = attn_fwd(q, k, v, causal=True)
    with pytest.raises(ValueError, match=r"hopper backward: needs v.shape\[3\] == q.shape\[3\]"):
        hopper_attn_bwd(do[..., :32], q, k, v[..., :32], o[..., :32], lse, AttnSpec(causal=True))


def test_hands_on_with_one_warning_per_reason_or_raises_when_strict(monkeypatch):
    # On CPU the Gluon kernels never run ("needs an sm_90 GPU"): the Triton kernels run the call,
    # and the user is told once per reason and direction, naming both backends.
    q, k, v, do = _inputs(1, 70, 70, 2, 1, 64, torch.float32, device="cpu", seed=2)
    hopper = type(get_backend("hopper", q.device))()  # a fresh instance: nothing warned yet
    with pytest.warns(UserWarning) as caught:
        for _ in range(3):
            o, lse = attn_fwd(q, k, v, causal=True, backend=hopper)
            attn_bwd(do, q, k, v, o, lse, causal=True, backend=hopper)
    texts = sorted(str(w.message) for w in caught)
    assert len(texts) == 2, texts
    assert texts[0].startswith("backend='hopper' cannot run this backward on its Gluon kernels: it needs an sm_90 GPU")
    assert texts[1].startswith("backend='hopper' cannot run this forward on its Gluon kernels: it needs an sm_90 GPU")
    assert all("the Triton kernels (backend='triton') run it instead" in t for t in texts)

    strict = get_backend("hopper", q.device, strict=True)
    assert strict.strict and repr(strict) == "Backend('hopper', strict=True)"
    with pytest.raises(ValueError, match=r"backend='hopper' cannot run this forward on its Gluon kernels: it needs an "
                                         r"sm_90 GPU .*\(strict: get_backend\(\.\.\., strict=True\) or "
                                         r"RINGFLASH_STRICT_BACKEND=1 refuses to hand it on\)"):
        attn_fwd(q, k, v, causal=True, backend=strict)
    monkeypatch.setenv("RINGFLASH_STRICT_BACKEND", "1")
    assert get_backend("hopper", q.device) is strict
    with pytest.raises(ValueError, match="cannot run this forward"):
        ring_flash_attn_func(q, k, v, causal=True, backend="hopper")
    assert get_backend("hopper", q.device, strict=False) is not strict
    monkeypatch.setenv("RINGFLASH_STRICT_BACKEND", "yes")
    with pytest.raises(ValueError, match="RINGFLASH_STRICT_BACKEND must be 0 or 1, got 'yes'"):
        get_backend("hopper", q.device)


@pytest.mark.parametrize("sm90", [True, False])
def test_auto_runs_the_hopper_kernels_on_an_h100_unless_gradients_must_reproduce(monkeypatch, sm90):
    """auto: hopper on sm_90, triton on other GPUs and when bit-reproducible gradients are asked
    for; the reference on CPU. Its hand-on warning names auto, which the caller chose."""
    monkeypatch.setattr(backends, "_is_sm90", lambda device: sm90)
    gpu = torch.device("cuda", 0)  # only the device's type and the (faked) capability are read
    want = "hopper" if sm90 else "triton"
    assert backends.auto_backend(gpu) == get_backend(None, gpu).name == get_backend("auto", gpu).name == want
    assert backends.auto_backend(gpu, deterministic=True) == "triton"
    assert get_backend("auto", gpu, deterministic=True).name == "triton"
    with torch_deterministic():
        assert get_backend("auto", gpu).name == "triton"
    assert get_backend("auto", torch.device("cpu")).name == backends.auto_backend(torch.device("cpu")) == "reference"
    if sm90:
        auto = type(get_backend("auto", gpu))(chosen_as="auto")  # a fresh instance: nothing warned yet
        with pytest.warns(UserWarning, match=r"^backend='auto' \(the Hopper kernels here\) cannot run this forward"):
            assert auto.handed_on("forward", "needs fp16 or bf16 inputs, got torch.float32")
        assert get_backend("auto", gpu, strict=True).strict  # strict refuses under auto too


@contextlib.contextmanager
def torch_deterministic():
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before)


def test_planner_names_the_kernels_that_run():
    hopper = get_backend("hopper", torch.device("cpu"))
    assert hopper.kernels_for(torch.bfloat16, 128) == "hopper"
    assert hopper.kernels_for(torch.bfloat16, 128, 128) == "hopper"
    assert hopper.kernels_for(torch.bfloat16, 192, 128) == "triton"
    assert hopper.kernels_for(torch.float32, 64) == "triton"
    assert hopper.kernels_for(None, None) == "hopper"  # not known yet: the kernels it asks for
    assert get_backend("triton", torch.device("cpu")).kernels_for(torch.bfloat16, 128) == "triton"


@pytest.mark.parametrize("mode", ["accumulate", "ring", "acc float32", "acc bf16", "new"])
def test_where_dq_is_summed(monkeypatch, mode):
    # Host side of the backward, on CPU: the kernel adds dQ's partials into the float32 tensor behind
    # its dQ descriptor. A stand-in kernel adds ones there; what reaches out's dq, and that acc is
    # never written, is the wrapper's doing.
    class AddsOnes:
        def __getitem__(self, grid):
            def run(q_desc, do_desc, k_desc, v_desc, dq_desc, *args, **kwargs):
                dq_desc.base.add_(1.0)
            return run

    monkeypatch.setattr(hopper_bwd, "_hopper_bwd", AddsOnes())
    monkeypatch.setattr(hopper_bwd, "unsupported", lambda q, k, v, spec: None)
    q, k, v, do = _inputs(1, 40, 40, 2, 1, 64, torch.bfloat16, device="cpu", seed=2)
    o, lse = attn_fwd(q, k, v, causal=True, backend="reference")
    start = torch.randn(q.shape)
    sums = (start.clone(), torch.zeros(k.shape), torch.zeros(v.shape))
    if mode == "accumulate":  # the ring's running float32 sums: dQ is added straight into them
        dq, *_ = hopper_attn_bwd(do, q, k, v, o, lse, AttnSpec(causal=True), grad_dtype=torch.float32, out=sums,
                                 accumulate=True)
        assert dq is sums[0] and torch.equal(dq, start + 1)
    elif mode == "ring":  # the ring's call: its running sums are both what is added to and where it goes
        dq, *_ = hopper_attn_bwd(do, q, k, v, o, lse, AttnSpec(causal=True), grad_dtype=torch.float32, out=sums,
                                 acc=sums)
        assert dq is sums[0] and torch.equal(dq, start + 1)
    elif mode.startswith("acc"):
        acc = sums if mode == "acc float32" else tuple(t.to(torch.bfloat16) for t in sums)
        before = acc[0].clone()
        out = (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v))
        dq, *_ = hopper_attn_bwd(do, q, k, v, o, lse, AttnSpec(causal=True), out=out, acc=acc)
        assert dq is out[0] and torch.equal(acc[0], before)  # acc is only read
        assert torch.equal(dq, (before.float() + 1).to(torch.bfloat16))
    else:
        dq, *_ = hopper_attn_bwd(do, q, k, v, o, lse, AttnSpec(causal=True))
        assert dq.dtype == torch.bfloat16 and torch.equal(dq, torch.ones_like(dq))


def test_deterministic_true_refuses_it():
    q, k, v, _ = _inputs(1, 32, 32, 2, 2, 16, torch.float32, device="cpu")
    with pytest.raises(ValueError, match="backend 'hopper' is not deterministic"):
        ring_flash_attn_func(q, k, v, causal=True, deterministic=True, backend="hopper")
