"""`bwd_step(out=..., accumulate=..., acc=...)`: gradients written into, or added to, given buffers
(the ring's path).

The ring hands the backward strided views of its float32 accumulators and sums dq and dK/dV over
its steps on chip; these tests check both against the float64 ground truth, on both backends.
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.steps import bwd_step
from tests.truth import attention_f64, rel_err

BACKENDS = ["reference", "triton"]


def _inputs(B=2, N=40, H=4, Hkv=2, D=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, N, H, D, generator=g)
    k, v = (torch.randn(B, N, Hkv, D, generator=g) for _ in range(2))
    return q, k, v, torch.randn(B, N, H, D, generator=g)


@pytest.mark.parametrize("backend", BACKENDS)
def test_out_views_and_accumulated_gradients(backend):
    # Two key halves: their gradients sum to the full one when each uses the global o and lse.
    # The first half writes (over 7s); the second adds: dq to the first half's, dK/dV of its keys
    # to what their buffers already hold (random, as a ring rank's partial sums would be).
    q, k, v, do = _inputs()
    truth = attention_f64(q, k, v, causal=False, do=do)
    o, lse = truth["o"].float(), truth["lse"].float()
    dq = torch.full((2, 60, 4, 32), 7.0)[:, 10:50]  # a strided view
    n = 24
    held = torch.randn(2, 2, 40 - n, 2, 32, generator=torch.Generator().manual_seed(1))
    dkv = torch.cat((torch.full((2, 2, n, 2, 32), 7.0), held), dim=2)
    for i, keys in enumerate((slice(0, n), slice(n, 40))):
        ret = bwd_step(
            do, q, k[:, keys], v[:, keys], o, lse, grad_dtype=torch.float32,
            out=(dq, dkv[0][:, keys], dkv[1][:, keys]), accumulate=i > 0, backend=backend,
        )
        assert ret[0].data_ptr() == dq.data_ptr() and ret[1].data_ptr() == dkv[0][:, keys].data_ptr()
    dkv[:, :, n:] -= held
    assert rel_err(dq, truth["dq"]) < 2e-5
    assert rel_err(dkv[0], truth["dk"]) < 2e-5 and rel_err(dkv[1], truth["dv"]) < 2e-5


@pytest.mark.parametrize(
    ("backend", "device"),
    [("reference", "cpu"), ("triton", "cpu"), pytest.param("triton", "cuda", marks=pytest.mark.gpu)],
)
@pytest.mark.parametrize("n_keys", [40, 0])
@pytest.mark.parametrize("sums_in", ["float32", "inputs"])
def test_sums_read_from_acc_and_written_rounded(backend, device, n_keys, sums_in):
    # The ring's last step: add this block's gradients to float32 sums held elsewhere (`acc`) and
    # write the totals in the input dtype. Bit-identical to adding in float32, then rounding. The
    # sums may be in the inputs' dtype (one rounded block result, as cuDNN's: `Backend.partial_dtype`).
    # (float16 on CPU: Triton's interpreter truncates to bfloat16 where GPUs round to nearest.)
    dtype = torch.bfloat16 if device == "cuda" else torch.float16
    q, k, v, do = (t.to(device, dtype) for t in _inputs())
    k, v = k[:, :n_keys], v[:, :n_keys]
    o, lse = torch.randn_like(q), torch.randn(2, 4, 40, device=device)
    # Sums and outputs with different strides (views with other batch / head strides), so that a
    # kernel reading the sums with the outputs' strides is caught.
    gen = torch.Generator().manual_seed(2)
    sums = (torch.randn(2, 50, 4, 32, generator=gen)[:, 5:45],
            *(torch.randn(2, n_keys, 2, 64, generator=gen)[..., :32] for _ in "kv"))  # fmt: skip
    sums = tuple(t.to(device, torch.float32 if sums_in == "float32" else dtype) for t in sums)
    before = tuple(t.clone() for t in sums)
    f32 = tuple(t.to(torch.float32, copy=True) for t in sums)
    bwd_step(do, q, k, v, o, lse, grad_dtype=torch.float32, out=f32, accumulate=True, backend=backend)
    out = tuple(torch.empty(t.shape, dtype=dtype, device=device) for t in sums)
    ret = bwd_step(do, q, k, v, o, lse, out=out, acc=sums, backend=backend)
    assert all(r is t for r, t in zip(ret, out))
    for got, want, s, b in zip(out, f32, sums, before):
        assert torch.equal(got, want.to(dtype))
        assert torch.equal(s, b)  # acc is read, never written
    if sums_in == "inputs":  # rounded sums are only read: summing into them in place is refused
        with pytest.raises(ValueError, match=r"acc dq in torch\.\w+ is only read: summing into it in place"):
            bwd_step(do, q, k, v, o, lse, out=sums, acc=sums, backend=backend)


def _half_ulps_off(got: torch.Tensor, exact: torch.Tensor, slack: torch.Tensor) -> torch.Tensor:
    """How far `got` (half precision) lies from `exact` (float32), in halves of `got`'s last place,
    after `slack` (float32 rounding in exact's own inputs): at most 1 where exact was rounded once."""
    _, e = torch.frexp(torch.maximum(got.float().abs(), exact.abs()))  # |x| in [2^(e-1), 2^e)
    half_ulp = torch.ldexp(torch.full_like(exact, torch.finfo(got.dtype).eps), e - 2)
    return ((got.float() - exact).abs() - slack).clamp(min=0) / half_ulp


@pytest.mark.parametrize(
    ("backend", "device"),
    [("reference", "cpu"), ("triton", "cpu"), pytest.param("triton", "cuda", marks=pytest.mark.gpu)],
)
def test_accumulate_adds_in_float32_then_rounds(backend, device):
    # `accumulate=True` into half-precision out: what out holds plus this block's float32
    # gradients, rounded once, on both backends (the reference used to round the block first,
    # which is up to a whole last place off). Not bit-equal to rounding out + g: a kernel may fuse
    # the softmax scale's multiply into the add (one float32 rounding fewer), so the bound allows
    # float32's rounding of the terms.
    dtype = torch.bfloat16 if device == "cuda" else torch.float16
    gen = torch.Generator().manual_seed(3)
    q, k, v, do = (t.to(device, dtype) for t in _inputs())
    o, lse = (torch.randn(shape, generator=gen).to(device) for shape in (q.shape, (2, 4, 40)))
    o = o.to(dtype)
    grads = bwd_step(do, q, k, v, o, lse, grad_dtype=torch.float32, backend=backend)
    out = tuple(torch.randn(g.shape, generator=gen).to(device, dtype) for g in grads)
    exact = tuple(t.float() + g for t, g in zip(out, grads))
    slack = tuple(2.0**-20 * (t.float().abs() + g.abs()) for t, g in zip(out, grads))
    bwd_step(do, q, k, v, o, lse, out=out, accumulate=True, backend=backend)
    for name, got, x, s in zip(("dq", "dk", "dv"), out, exact, slack):
        off = _half_ulps_off(got, x, s)
        assert off.max() <= 1, f"{name}: {off.max():.3f} half-ulps from the float32 sum"
    assert torch.equal(out[2], exact[2].to(dtype))  # dV has no scale to fuse: bit-equal


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("accumulate", [False, True])
def test_no_keys_writes_zeros_or_adds_nothing(backend, accumulate):
    q, k, v, do = _inputs()
    k, v = k[:, :0], v[:, :0]
    o, lse = torch.zeros_like(q), torch.full((2, 4, 40), -torch.inf)
    held = (torch.randn(q.shape), torch.randn(k.shape), torch.randn(v.shape))
    out = tuple(t.clone() for t in held)
    bwd_step(do, q, k, v, o, lse, grad_dtype=torch.float32, out=out, accumulate=accumulate, backend=backend)
    for got, before in zip(out, held):
        assert torch.equal(got, before if accumulate else torch.zeros_like(before))


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_out_names_the_buffer(backend):
    q, k, v, do = _inputs()
    o, lse = torch.randn_like(q), torch.randn(2, 4, 40)
    good = (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v))
    with pytest.raises(ValueError, match="accumulate=True needs out"):
        bwd_step(do, q, k, v, o, lse, accumulate=True, backend=backend)
    with pytest.raises(ValueError, match="out dk must have shape"):
        bwd_step(do, q, k, v, o, lse, out=(good[0], good[1][:, :5], good[2]), backend=backend)
    with pytest.raises(TypeError, match=r"out dq must have the gradient dtype torch\.float16"):
        bwd_step(do, q, k, v, o, lse, grad_dtype=torch.float16, out=good, backend=backend)
    with pytest.raises(ValueError, match="acc= needs out"):
        bwd_step(do, q, k, v, o, lse, acc=good, backend=backend)
    with pytest.raises(ValueError, match="not both"):
        bwd_step(do, q, k, v, o, lse, out=good, accumulate=True, acc=good, backend=backend)
    with pytest.raises(TypeError, match=r"acc dv must be float32 \(running sums\), got torch\.float16"):
        bwd_step(do, q, k, v, o, lse, out=good, acc=(*good[:2], good[2].half()), backend=backend)
    every_other = torch.empty(2, 40, 4, 64)[..., ::2]  # dq's shape, last-dim stride 2
    with pytest.raises(ValueError, match=r"out dq must have a contiguous last dim \(stride 1\)"):
        bwd_step(do, q, k, v, o, lse, out=(every_other, *good[1:]), backend=backend)
    with pytest.raises(ValueError, match=r"acc dq must have a contiguous last dim \(stride 1\)"):
        bwd_step(do, q, k, v, o, lse, out=good, acc=(every_other, *good[1:]), backend=backend)
    with pytest.raises(ValueError, match="out dv must be on q's device"):
        bwd_step(do, q, k, v, o, lse, out=(*good[:2], good[2].to("meta")), backend=backend)


@pytest.mark.parametrize(
    ("backend", "device"),
    [("reference", "cpu"), ("triton", "cpu"), pytest.param("triton", "cuda", marks=pytest.mark.gpu)],
)
@pytest.mark.parametrize("n_keys", [40, 0])
def test_after_dkdv_runs_once_between_dkdv_and_dq(backend, device, n_keys):
    # The ring sends dK/dV on from this hook while dQ is computed: they must be final by then.
    q, k, v, do = (t.to(device) for t in _inputs())
    k, v = k[:, :n_keys], v[:, :n_keys]
    truth = attention_f64(q, k, v, causal=False, do=do) if n_keys else None
    if n_keys:
        o, lse = truth["o"].float(), truth["lse"].float()
    else:  # no keys: o = 0, lse = -inf
        o, lse = torch.zeros_like(q), torch.full((2, 4, 40), -torch.inf, device=device)
    out = (torch.full_like(q, 7.0), torch.full_like(k, 7.0), torch.full_like(v, 7.0))
    seen = []

    def hook():
        if device == "cuda":
            torch.cuda.synchronize()  # what is queued so far has run; dQ is not queued yet
        dkdv_ok = rel_err(out[1], truth["dk"]) < 2e-5 and rel_err(out[2], truth["dv"]) < 2e-5 if n_keys else True
        seen.append((dkdv_ok, bool((out[0] == 7.0).all())))

    bwd_step(do, q, k, v, o, lse, grad_dtype=torch.float32, out=out, after_dkdv=hook, backend=backend)
    assert seen == [(True, True)]  # once; dK/dV written, dQ not yet
    assert rel_err(out[0], truth["dq"]) < 2e-5 if n_keys else (out[0] == 0).all()


_sm90 = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                           reason="the hopper kernels need an sm_90 GPU")


@pytest.mark.parametrize(
    ("backend", "device"),
    [("reference", "cpu"), ("triton", "cpu"), pytest.param("triton", "cuda", marks=pytest.mark.gpu),
     pytest.param("hopper", "cuda", marks=[pytest.mark.gpu, _sm90]),
     pytest.param("cudnn", "cuda", marks=pytest.mark.gpu)],
)
@pytest.mark.parametrize("into", ["sums", "rounded"])
def test_acc_is_read_only_after_acc_ready(backend, device, into):
    # A ring waits in `acc_ready` for the dK/dV sums arriving from the previous rank: nothing may
    # read them before. Here they hold NaN until `acc_ready` writes them, on the stream, as the
    # arriving transfer would. The Gluon backward calls it after its kernel (whose in-place dQ sums
    # have then changed), so the sums travel while it runs; the Triton one before its kernels.
    # `into`: the sums added to in place (a ring's middle steps) or the totals written rounded (its last).
    dtype, d = (torch.bfloat16, 64) if device == "cuda" else (torch.float32, 32)
    q, k, v, do = _inputs(D=d, seed=3)
    truth = attention_f64(q, k, v, causal=False, do=do)
    q, k, v, do = (t.to(device, dtype) for t in (q, k, v, do))
    o, lse = truth["o"].to(device, dtype), truth["lse"].float().to(device)
    grads = bwd_step(do, q, k, v, o, lse, grad_dtype=torch.float32, backend=backend)
    gen = torch.Generator().manual_seed(4)
    arrived = tuple(torch.randn(g.shape, generator=gen).to(device) for g in grads)
    sums = tuple(a.clone() for a in arrived)
    for t in sums[1:]:
        t.fill_(float("nan"))
    out = sums if into == "sums" else tuple(torch.full_like(t, 7.0) for t in (q, k, v))
    seen = []

    def ready():
        if device == "cuda":
            torch.cuda.synchronize()
        seen.append(("ready", not torch.equal(sums[0], arrived[0])))
        for t, a in zip(sums[1:], arrived[1:]):
            t.copy_(a)

    bwd_step(do, q, k, v, o, lse, grad_dtype=torch.float32 if into == "sums" else None, out=out, acc=sums,
             acc_ready=ready, after_dkdv=lambda: seen.append(("after_dkdv", None)), backend=backend)
    assert [what for what, _ in seen] == ["ready", "after_dkdv"]
    if into == "sums":
        assert seen[0][1] == (backend == "hopper")  # its kernel summed dQ before: it ran first
    tol = 1e-5 if device == "cpu" else 1e-3 if into == "sums" else 1e-2
    for name, got, a, g in zip(("dq", "dk", "dv"), out, arrived, grads):
        assert rel_err(got.float(), a + g) < tol, name
