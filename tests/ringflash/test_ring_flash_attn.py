"""The drop-in for ring-flash-attention (ringflash/ring_flash_attn.py).

- The peer's own test scripts (tests/ringflash/peer/, changed only in their imports, backend and
  device) run under torchrun on 2 gloo ranks; they only print max |diff| against flash_attn's
  reference, so the assertions are here, on what they print.
- The peer's signatures, argument for argument, and a misused call's error naming the function.
- Every (B, N_local) name, each packing, on the layout its name stands for, against float64; one
  compiled whole.
- Varlen forms with windows and without causality (the scripts test causal only) against a
  float64 truth per document.
- Bad input, on one rank or differing between ranks, raises on every rank and leaves the group
  usable.
"""

from __future__ import annotations

import inspect
import re

import pytest
import torch

import ringflash
from ringflash import ring_flash_attn as peer
from tests.dist_utils import REPO, run_ranks, torchrun
from tests.truth import TOL, attention_f64, lse_err, rel_err

PEER_DIR = REPO / "tests" / "ringflash" / "peer"
SCRIPTS = [
    "test_ring_flash_attn_func.py",
    "test_zigzag_ring_flash_attn_func.py",
    "test_ring_flash_attn_varlen_func.py",
    "test_zigzag_ring_flash_attn_varlen_func.py",
]
LINE = re.compile(r"^(?:\[(\d+)\] )?(?:(.+): )?max (\S+), mean (\S+)$")


def _logged(stdout: str) -> list[tuple[str, int | None, float]]:
    """(name, rank or None for a rank-0-only line, max) for each line of the scripts' `log`."""
    out, name = [], None
    for line in stdout.splitlines():
        if line.endswith(":") and "max" not in line:
            name = line[:-1]  # the header of a per-rank block: "dq diff:", "lse diff 0:"
            continue
        m = LINE.match(line.strip())
        if m:
            rank, own, mx, _ = m.groups()
            out.append((own if own is not None else name, None if rank is None else int(rank), float(mx)))
    return out


@pytest.mark.slow  # torchrun launches of the peer's scripts, 20–45 s each
@pytest.mark.parametrize("script", SCRIPTS)
def test_peer_script(script):
    # bf16 on both sides: ring and reference round o and the gradients once to bf16, so each
    # may be off by about an ulp of the largest values (2^-8 relative); 2^-6 allows a few ulps.
    # lse is float32 on both sides from the same bf16 inputs: float32 rounding only.
    world = 2
    run = torchrun(PEER_DIR / script, nproc=world, cwd=PEER_DIR, timeout=400)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    logged = _logged(run.stdout)
    scale: dict[str, float] = {}
    checked = set()
    for name, rank, mx in logged:
        if "diff" not in name:
            scale[name] = max(scale.get(name, 0.0), mx) if rank is not None else mx
            continue
        base = name.replace(" diff", "")
        ref = scale["local_dqkv" if base in ("dq", "dk", "dv") else base]
        tol = (1e-5 if base.startswith("lse") else 2**-6) * max(ref, 1.0)
        assert mx <= tol, f"{script}: {name} on rank {rank}: max |diff| {mx} > {tol}"
        checked.add((name.split()[0], rank))
    want = {(n, r) for n in ("out", "lse", "dq", "dk", "dv") for r in range(world)}
    assert checked == want, f"{script}: expected diffs of {sorted(want)}, the script logged {sorted(checked)}"


FLASH = ["dropout_p", "softmax_scale", "causal", "window_size", "alibi_slopes", "deterministic",
         "return_attn_probs", "group"]  # fmt: skip


def test_signatures_are_the_peers():
    # The peer's, at the vendored commit: positional calls land on the same arguments.
    heads = {"func": ["q", "k", "v"], "kvpacked": ["q", "kv"], "qkvpacked": ["qkv"]}
    for name in peer.__all__:
        if name.startswith("llama3"):  # all-gather: its own signatures (test_ring_flash_attn_llama3.py)
            continue
        head = heads[next((k for k in ("qkvpacked", "kvpacked") if k in name), "func")]
        head = [*head, "cu_seqlens", "max_seqlen"] if "varlen" in name else head
        params = inspect.signature(getattr(peer, name)).parameters
        assert list(params) == head + FLASH, name
        assert params["causal"].default is False and params["window_size"].default == (-1, -1)
    # ringflash's own: flash_attn's order, then keyword-only options.
    params = inspect.signature(ringflash.ring_flash_attn_func).parameters
    positional = [n for n, p in params.items() if p.kind is p.POSITIONAL_OR_KEYWORD]
    assert positional == ["q", "k", "v", *FLASH]
    assert all(params[n].kind is inspect.Parameter.KEYWORD_ONLY for n in ("layout", "mask", "window", "backend"))


def test_misuse_is_pythons_error_naming_the_function():
    q = torch.randn(1, 4, 2, 16)
    with pytest.raises(TypeError, match=r"^zigzag_ring_flash_attn_func\(\) missing a required argument: 'v'$"):
        peer.zigzag_ring_flash_attn_func(q, q)
    unexpected = r"^ring_flash_attn_kvpacked_func\(\) got an unexpected keyword argument 'layout'$"
    with pytest.raises(TypeError, match=unexpected):  # the layout is the name's
        peer.ring_flash_attn_kvpacked_func(q, q, layout="zigzag")
    with pytest.raises(TypeError, match=r"^stripe_flash_attn_qkvpacked_func\(\) too many positional arguments$"):
        peer.stripe_flash_attn_qkvpacked_func(q, *[None] * 9)


# ---- (B, N_local, H, D): every layout and packing against float64 ------------------------------

BATCHED = [n for n in peer.__all__ if "varlen" not in n and "prepare" not in n]


def _batched_worker(rank, world):
    g = torch.Generator().manual_seed(2)
    B, N, H, D = 2, 8 * world, 2, 16
    q, k, v, do = (torch.randn(B, N, H, D, generator=g) for _ in range(4))
    truth = attention_f64(q, k, v, True, None, do)
    for name in BATCHED:
        layout = "zigzag" if name.startswith("zigzag") else "stripe" if name.startswith("stripe") else "contiguous"
        local = lambda x, dim=1, layout=layout: ringflash.shard(x, dim, rank, world, layout=layout)
        ql, kl, vl = (local(t).requires_grad_() for t in (q, k, v))
        if "qkvpacked" in name:
            args = (torch.stack((ql, kl, vl), 2),)
        elif "kvpacked" in name:
            args = (ql, torch.stack((kl, vl), 2))
        else:
            args = (ql, kl, vl)
        o, lse, none = getattr(peer, name)(*args, 0.0, None, True, return_attn_probs=True)
        o.backward(local(do))
        assert none is None, name
        got = {"o": o, "dq": ql.grad, "dk": kl.grad, "dv": vl.grad}
        errs = {n: rel_err(x, local(truth[n])) for n, x in got.items()}
        errs["lse"] = lse_err(lse, local(truth["lse"], 2)) / 10
        assert all(e < TOL[torch.float32] for e in errs.values()), f"{name} on rank {rank}: {errs}"


def test_batched_names_attend_on_their_layouts():
    # The name fixes the layout: a row of the table pointing at another layout shards the
    # sequence differently from the truth sharded here, and fails.
    assert len(BATCHED) == 9
    run_ranks(_batched_worker, 2)


def _compiled_worker(rank, world):
    from torch._dynamo.testing import CompileCounterWithBackend

    g = torch.Generator().manual_seed(3)
    q, kv = torch.randn(1, 8 * world, 2, 16, generator=g), torch.randn(1, 8 * world, 2, 2, 16, generator=g)
    ql, kvl = (ringflash.shard(t, 1, rank, world, layout="zigzag") for t in (q, kv))
    fn = lambda q, kv: peer.zigzag_ring_flash_attn_kvpacked_func(q, kv, 0.0, None, True)
    counter = CompileCounterWithBackend("aot_eager")
    got = torch.compile(fn, backend=counter, fullgraph=True)(ql, kvl)  # a graph break raises
    torch.testing.assert_close(got, fn(ql, kvl), rtol=0, atol=0)
    assert counter.frame_count == 1


@pytest.mark.slow  # a Dynamo trace, ~10 s
def test_drop_in_compiles_whole():
    # The names bind their arguments through the peer's signature at each call; Dynamo traces it.
    run_ranks(_compiled_worker, 2, timeout_s=120)


# ---- varlen: windows and full attention against float64, per document --------------------------


def _truth(q, k, v, do, lengths, causal, window):
    """Per document, float64: o, lse (H, total), dq, dk, dv (all global, unsharded)."""
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    outs, lses, start = [], [], 0
    for n in lengths:
        sl = slice(start, start + n)
        s = torch.einsum("qhd,khd->hqk", q64[sl], k64[sl].repeat_interleave(q.shape[1] // k.shape[1], 1))
        s = s * q.shape[-1] ** -0.5
        i, j = torch.arange(n)[:, None], torch.arange(n)[None]
        hidden = (j > i) | (j <= i - window) if window else (j > i) if causal else torch.zeros(n, n, dtype=torch.bool)
        s = s.masked_fill(hidden, float("-inf"))
        lses.append(torch.logsumexp(s, -1))
        vr = v64[sl].repeat_interleave(q.shape[1] // k.shape[1], 1)
        outs.append(torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), vr))
        start += n
    o = torch.cat(outs)
    o.backward(do.double())
    return {"o": o.detach(), "lse": torch.cat(lses, 1).detach(), "dq": q64.grad, "dk": k64.grad, "dv": v64.grad}


def _per_document(x, lengths, rank, world, layout):
    """This rank's pieces of every document (the peer's varlen sharding), along dim 0 (dim -1 for lse)."""
    dim = -1 if x.dim() == 2 else 0
    pieces, start = [], 0
    for n in lengths:
        chunks = x.narrow(dim, start, n).chunk(world if layout == "contiguous" else 2 * world, dim=dim)
        pieces += [chunks[rank]] if layout == "contiguous" else [chunks[rank], chunks[2 * world - 1 - rank]]
        start += n
    return torch.cat(pieces, dim)


def _varlen_worker(rank, world, layout, causal, window_size, lengths):
    g = torch.Generator().manual_seed(0)
    total, H, Hkv, D = sum(lengths), 4, 2, 16
    q, do = (torch.randn(total, H, D, generator=g) for _ in range(2))
    kv = torch.randn(total, 2, Hkv, D, generator=g)
    window = window_size[0] + 1 if window_size[0] >= 0 else None
    truth = _truth(q, kv[:, 0], kv[:, 1], do, lengths, causal, window)
    ql, kvl = (_per_document(t, lengths, rank, world, layout).requires_grad_() for t in (q, kv))
    local = [n // world for n in lengths]
    cu = torch.tensor([0, *torch.tensor(local).cumsum(0).tolist()], dtype=torch.int32)
    fn = peer.ring_flash_attn_varlen_kvpacked_func if layout == "contiguous" else (
        peer.zigzag_ring_flash_attn_varlen_kvpacked_func)  # fmt: skip
    o, lse, none = fn(ql, kvl, cu, max(local), 0.0, None, causal, window_size, None, True, True)
    o.backward(_per_document(do, lengths, rank, world, layout))
    assert none is None and lse.shape == (H, sum(local))
    got = {"o": o, "lse": lse, "dq": ql.grad, "dk": kvl.grad[:, 0], "dv": kvl.grad[:, 1]}
    for name, x in got.items():
        want = _per_document(truth[name], lengths, rank, world, layout)
        torch.testing.assert_close(x.double(), want, atol=2e-5, rtol=2e-5, msg=f"{name} on rank {rank}")


@pytest.mark.parametrize(
    "layout, causal, window_size, lengths",
    [("contiguous", True, (4, 0), [6, 10, 16]),  # odd local lengths: only zigzag needs them even
     ("zigzag", True, (6, 0), [4, 12, 16]),
     ("zigzag", False, (-1, -1), [4, 12, 16]),  # the peer asserts causal here; we need not
     ("contiguous", False, (-1, -1), [6, 10, 16])],
)  # fmt: skip
def test_varlen_windows_and_full_attention(layout, causal, window_size, lengths):
    run_ranks(_varlen_worker, 2, (layout, causal, window_size, lengths))


def _varlen_value_dim_worker(rank, world, layout):
    # v's own head dim (DeepSeek's MLA) through the unpacked varlen form: o and dv have v's.
    g = torch.Generator().manual_seed(0)
    lengths, H, Hkv = [4, 12, 16], 4, 2
    total, local = sum(lengths), [n // world for n in lengths]
    q, k = torch.randn(total, H, 16, generator=g), torch.randn(total, Hkv, 16, generator=g)
    v, do = torch.randn(total, Hkv, 8, generator=g), torch.randn(total, H, 8, generator=g)
    truth = _truth(q, k, v, do, lengths, True, None)
    ql, kl, vl = (_per_document(t, lengths, rank, world, layout).requires_grad_() for t in (q, k, v))
    cu = torch.tensor([0, *torch.tensor(local).cumsum(0).tolist()], dtype=torch.int32)
    fn = peer.ring_flash_attn_varlen_func if layout == "contiguous" else peer.zigzag_ring_flash_attn_varlen_func
    o = fn(ql, kl, vl, cu, max(local), causal=True)
    o.backward(_per_document(do, lengths, rank, world, layout))
    for name, x in {"o": o, "dq": ql.grad, "dk": kl.grad, "dv": vl.grad}.items():
        want = _per_document(truth[name], lengths, rank, world, layout)
        torch.testing.assert_close(x.double(), want, atol=2e-5, rtol=2e-5, msg=f"{name} on rank {rank}")


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_varlen_value_head_dim(layout):
    run_ranks(_varlen_value_dim_worker, 2, (layout,))


# ---- refused on every rank ---------------------------------------------------------------------


def _error_worker(rank, world, what):
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(8, 2, 16, generator=g) for _ in range(3))
    cu = torch.tensor([0, 2, 8], dtype=torch.int32)
    args, fn = [q, k, v, cu, 6], peer.zigzag_ring_flash_attn_varlen_func
    kwargs = dict(causal=True)
    others = r"rank\(s\) \[1\] of the group rejected"
    if what == "odd zigzag document":
        expect = "local document lengths must be even" if rank == 1 else others
        if rank == 1:
            args[3] = torch.tensor([0, 3, 8], dtype=torch.int32)
    elif what == "cu_seqlens past the tokens":
        expect = "cu_seqlens must rise from 0 to the local token count 8" if rank == 1 else others
        if rank == 1:
            args[3] = torch.tensor([0, 2, 10], dtype=torch.int32)
    elif what == "documents differ":
        expect = r"differ between the ranks of the group: the mask"
        args[3] = torch.tensor([0, 2, 8] if rank == 0 else [0, 4, 8], dtype=torch.int32)
    elif what == "dropout":
        expect = "dropout_p=0.1" if rank == 1 else others
        kwargs["dropout_p"] = 0.1 if rank == 1 else 0.0
    elif what == "packed qkv shape":
        expect = r"qkv must have shape \(total, 3, heads, head_dim\)" if rank == 1 else others
        qkv = torch.stack((q, k, v), 1)
        args, fn = [qkv[:, :2] if rank == 1 else qkv, cu, 6], peer.zigzag_ring_flash_attn_varlen_qkvpacked_func
    elif what == "fixed-length two-sided window":
        expect = r"window_size=\(2, 2\)" if rank == 1 else others
        args, fn = [q[None], k[None], v[None]], peer.ring_flash_attn_func
        kwargs["window_size"] = (2, 2) if rank == 1 else (2, 0)
    with pytest.raises((ValueError, TypeError), match=expect) as err:
        fn(*args, **kwargs)
    peer.zigzag_ring_flash_attn_varlen_func(q, k, v, cu, 6, causal=True)  # the group still works
    return str(err.value)


@pytest.mark.parametrize(
    "what",
    ["odd zigzag document", "cu_seqlens past the tokens", "documents differ", "dropout", "packed qkv shape",
     "fixed-length two-sided window"],
)
def test_bad_input_raises_on_every_rank(what):
    assert len(run_ranks(_error_worker, 2, (what,), timeout_s=20)) == 2
