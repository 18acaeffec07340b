"""torch.compile through the custom ops: no graph break inside attention, same numbers as eager.

- The kernel ops (`kernels/ops.py`) pass `torch.library.opcheck`: schema, fake implementation,
  autograd registration and AOT dispatch, on the reference and on the Triton kernels (on the
  GPU if there is one, else interpreted), and the ring op on one rank.
- The ring op (`ringflash/ops.py`) under 2 gloo ranks: the tiny transformer of train/model.py
  with `RingFlashAttention`, compiled *whole* with `fullgraph=True` (any graph break is an
  error), gives the eager loss and gradients; one case with inductor (which compiles C++ on
  CPU, so the shapes are tiny), the others with `aot_eager`.
- The cross-rank check still runs under compile (inside the op) and a rank's rejected inputs
  still make every rank raise.
- `gpu`: the same transformer compiled with inductor on CUDA (2 gloo ranks sharing the GPU).

CPU time: about 20 s with a warm inductor cache, 45 s cold (the inductor case compiles C++).
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo  # imported (slowly) once here, so every forked rank inherits it

import ringflash
from ringflash import kernels  # registers torch.ops.ringflash.attn_fwd / attn_bwd
from ringflash.kernels import interpreting
from ringflash.train.config import ModelConfig
from ringflash.train.model import Transformer
from tests.dist_utils import RankFailure, run_ranks

TINY = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64)


# Every test does its work in child processes, even the single-process ones: a parent that has
# run a backward (autograd's threads) or, on a GPU machine, initialised CUDA cannot fork children
# that do. Fork where that is safe (fast); spawn on GPU machines, as tests/ringflash/test_ring.py does.
START = "spawn" if torch.cuda.is_available() else "fork"


def _kernel_opcheck_worker(rank, world, backend, device):
    g = torch.Generator().manual_seed(0)
    dt = torch.bfloat16 if backend == "cudnn" else torch.float32  # cuDNN takes no float32
    q = torch.randn(1, 12, 4, 32, generator=g).to(device, dt).requires_grad_()
    k, v = (torch.randn(1, 12, 2, 32, generator=g).to(device, dt).requires_grad_() for _ in range(2))
    opts = dict(causal=True, softmax_scale=0.3, backend=backend)
    torch.library.opcheck(torch.ops.ringflash.attn_fwd.default, (q, k, v, []), opts)
    o, lse = torch.ops.ringflash.attn_fwd(q, k, v, [], **opts)
    assert not lse.requires_grad
    do = torch.randn(o.shape, generator=g).to(device, dt)
    args = (do, q.detach(), k.detach(), v.detach(), o.detach(), lse)
    torch.library.opcheck(torch.ops.ringflash.attn_bwd.default, (*args, []), opts)
    if backend != "cudnn":  # the ops carry every mask the eager functions take: a window, intervals
        vis = list(kernels.dense_visibility(12, window=5, device=q.device))
        torch.library.opcheck(torch.ops.ringflash.attn_fwd.default, (q, k, v, []), dict(opts, window_size=[4, 0]))
        torch.library.opcheck(torch.ops.ringflash.attn_fwd.default, (q, k, v, vis), dict(opts, causal=False))
        ow, _ = torch.ops.ringflash.attn_fwd(q, k, v, [], **dict(opts, window_size=[4, 0]))
        ov, _ = torch.ops.ringflash.attn_fwd(q, k, v, vis, **dict(opts, causal=False))
        want = kernels.attn_fwd(q.detach(), k.detach(), v.detach(), causal=True, window_size=(4, 0), softmax_scale=0.3,
                                backend=backend)[0]
        torch.testing.assert_close(ow, want, atol=0, rtol=0)
        torch.testing.assert_close(ov, want, atol=0, rtol=0)
    # The op's autograd is the kernel pair's: gradients equal attn_bwd's.
    o.backward(do)
    ref = kernels.attn_bwd(*args, causal=True, softmax_scale=0.3, backend=backend)
    for got, want in zip((q.grad, k.grad, v.grad), ref):
        torch.testing.assert_close(got, want)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["reference", "triton", pytest.param("cudnn", marks=pytest.mark.gpu)])
def test_kernel_ops_opcheck(backend):
    # Triton in the interpreter in the CPU suite, else on the GPU (tests/conftest.py).
    device = "cuda" if backend == "cudnn" or (backend == "triton" and not interpreting()) else "cpu"
    run_ranks(_kernel_opcheck_worker, 1, args=(backend, device), start_method=START, timeout_s=120)


def _ring_opcheck_worker(rank, world, dv=16):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 8, 4, 16, generator=g, requires_grad=True)
    k = torch.randn(1, 8, 2, 16, generator=g, requires_grad=True)
    v = torch.randn(1, 8, 2, dv, generator=g, requires_grad=True)
    opts = dict(causal=True, softmax_scale=0.25, layout="zigzag", group_name="", backend=None, check_ranks=False)
    torch.library.opcheck(torch.ops.ringflash.ring_attn.default, (q, k, v, []), opts)


def test_ring_op_opcheck_one_rank():
    # A group of one: the op's world-1 path (one kernel call, k and v saved unpacked).
    run_ranks(_ring_opcheck_worker, 1, start_method=START, timeout_s=120)


def test_ring_op_opcheck_value_head_dim():
    # v's own head dim: o, the packed K/V block and dK/dV shaped by the fakes as the ring makes them.
    run_ranks(_ring_opcheck_worker, 2, args=(8,), start_method=START, timeout_s=120)


def _compiled_model_worker(rank, world, compile_backend, layout, device="cpu", cfg=TINY, masked=False):
    from torch._dynamo.testing import CompileCounterWithBackend

    if device == "cuda":
        torch.cuda.set_device(0)  # both ranks share the one GPU (gloo stages through host memory)
    torch.manual_seed(0)
    model = Transformer(cfg).to(device)
    for block in model.blocks:
        block.attn.core = ringflash.RingFlashAttention(layout=layout, causal=True)
    idx = torch.randint(0, cfg.vocab_size, (2, 8 * world), device=device)
    x = ringflash.shard(idx, 1, rank, world, layout=layout)
    pos = ringflash.global_positions(x.shape[1], rank, world, layout=layout, device=device)
    mask = None
    if masked:  # packed documents of odd lengths across the shards, and a window
        n = idx.shape[1]
        doc = torch.stack([torch.arange(n) * 3 // n, (torch.arange(n) >= 1).long() + (torch.arange(n) >= 11).long()])
        mask = ringflash.ring_mask(doc, layout=layout, window=6, device=device)

    def step(m):
        m.zero_grad(set_to_none=True)
        loss = (m(x, pos) if mask is None else m(x, pos, mask=mask)).float().square().mean()
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in m.parameters()]

    loss, grads = step(model)
    torch._dynamo.reset()
    counter = CompileCounterWithBackend(compile_backend)
    compiled = torch.compile(model, backend=counter, fullgraph=True)  # a graph break raises
    tol = dict(rtol=1e-5, atol=1e-6) if device == "cpu" else dict(rtol=1e-3, atol=1e-5)
    for _ in range(2):  # the second call must reuse the graph (no recompilation)
        c_loss, c_grads = step(compiled)
        torch.testing.assert_close(c_loss, loss, **tol)
        for a, b in zip(c_grads, grads):
            torch.testing.assert_close(a, b, rtol=100 * tol["rtol"], atol=tol["atol"])
    assert counter.frame_count == 1, f"{counter.frame_count} graphs compiled"
    return True


@pytest.mark.slow
@pytest.mark.parametrize(
    "compile_backend,layout", [("aot_eager", "zigzag"), ("aot_eager", "contiguous"), ("inductor", "zigzag")]
)
def test_compiled_transformer_matches_eager(compile_backend, layout):
    args = (compile_backend, layout)
    assert run_ranks(_compiled_model_worker, 2, args=args, start_method=START, timeout_s=120) == [True, True]


@pytest.mark.slow
def test_compiled_transformer_with_ring_mask():
    # Packed documents and a window: the mask's Visibility tensors are op inputs, its plan ints
    # are graph constants; still one graph, no break.
    args = ("aot_eager", "zigzag", "cpu", TINY, True)
    assert run_ranks(_compiled_model_worker, 2, args=args, start_method=START, timeout_s=120) == [True, True]


@pytest.mark.gpu
def test_compiled_transformer_gpu():
    # Inductor (Triton codegen) around the ring op with the Triton attention kernels; spawn,
    # not fork: conftest has already asked CUDA whether it is available.
    cfg = ModelConfig(vocab_size=64, dim=128, n_layers=2, n_heads=4, n_kv_heads=2)  # head_dim 32
    args = ("inductor", "zigzag", "cuda", cfg)
    assert run_ranks(_compiled_model_worker, 2, args=args, start_method="spawn", timeout_s=300) == [True, True]


def _mismatch_worker(rank, world, what):
    attn = torch.compile(ringflash.RingFlashAttention(causal=True), backend="aot_eager")
    n = 8 if rank == 0 else {"rejected": 7, "differ": 4}[what]
    q, k, v = torch.randn(1, n, 2, 16), torch.randn(1, n, 2, 16), torch.randn(1, n, 2, 16)
    attn(q, k, v)


@pytest.mark.parametrize(
    "what,rank0_says",
    [("rejected", "rank(s) [1] of the group rejected their inputs"), ("differ", "q.shape is (1, 8, 2, 16) on rank 0")],
)
def test_cross_rank_check_under_compile(what, rank0_says):
    with pytest.raises(RankFailure) as info:
        run_ranks(_mismatch_worker, 2, args=(what,), start_method=START, timeout_s=60)
    assert rank0_says in info.value.errors[0]
    assert "ValueError" in info.value.errors[1]
