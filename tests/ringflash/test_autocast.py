"""Under autocast, ring attention runs in autocast's dtype, as SDPA does.

A Llama's RoPE under autocast leaves q and k in float32 while v leaves its Linear in bf16: the
ring must take that call (transformers' path, the function, the module) and compute it in bf16,
no further from float64 than SDPA under the same autocast; outside autocast mixed dtypes raise.
On 2 gloo ranks with CPU autocast: the same casts CUDA autocast makes.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import ringflash
from ringflash.layout import shard, unshard
from tests.dist_utils import RankFailure, run_ranks

B, N, H, HKV, D = 2, 48, 4, 2, 16


def _sdpa(q, k, v):  # (B, N, H, D) in and out, GQA by repeating k and v
    k, v = (t.repeat_interleave(H // HKV, dim=2) for t in (k, v))
    o = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=True)
    return o.transpose(1, 2)


def _inputs():
    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(B, N, h, D, generator=g) for h in (H, HKV, HKV, H))
    return q, k, v.bfloat16(), do  # v as a bf16 Linear leaves it, q and k as float32 RoPE does


def _errors(rank, world):
    """This rank's error against float64 (o and the gradients of q, k, v) for the ring and SDPA,
    both under CPU autocast; each gathered whole."""
    q, k, v, do = _inputs()
    exact = [t.double().requires_grad_() for t in (q, k, v)]
    _sdpa(*exact).backward(do.double())
    errs = {}
    for name in ("ring", "sdpa"):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if name == "ring":
                local = [shard(t, 1, rank, world, "zigzag") for t in leaves]
                o_local = ringflash.RingFlashAttention(group=dist.group.WORLD)(*local)
                assert o_local.dtype == torch.bfloat16, o_local.dtype  # SDPA's dtype under autocast
                o_local.backward(shard(do, 1, rank, world, "zigzag").bfloat16())
                o = unshard(_all_gather(o_local.float()), 1, "zigzag")
                grads = [t.grad for t in leaves]
            else:
                o = _sdpa(*leaves)
                o.backward(do.bfloat16())
                grads = [t.grad for t in leaves]
        assert [g.dtype for g in grads] == [t.dtype for t in leaves]  # each leaf's own dtype
        if name == "ring":
            grads = [_sum_over_ranks(g) for g in grads]
        truth = [_sdpa(*exact).detach(), *(t.grad for t in exact)]
        errs[name] = [(a.double() - b).abs().max().item() for a, b in zip([o, *grads], truth)]
    return errs


def _all_gather(t):
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return out


def _sum_over_ranks(g):
    g = g.float().clone()
    dist.all_reduce(g)  # each rank's grad holds its own tokens' contribution to the whole leaf
    return g


def test_function_takes_autocast_inputs_and_runs_in_its_dtype():
    errs = run_ranks(_errors, 2, timeout_s=60)[0]
    for name, ring, sdpa in zip(("o", "dq", "dk", "dv"), errs["ring"], errs["sdpa"]):
        assert ring <= 2 * sdpa + 1e-3, f"{name}: ring {ring:.3g} against bf16 SDPA's {sdpa:.3g}"


def test_mixed_dtypes_outside_autocast_raise():
    q, k, v, _ = _inputs()
    with pytest.raises(TypeError, match=r"v.dtype must equal q.dtype \(torch.float32\), got torch.bfloat16"):
        ringflash.ring_flash_attn_func(q, k, v, causal=True)


def _hf_autocast(rank, world):
    transformers = pytest.importorskip("transformers")
    import ringflash.hf as rh

    cfg = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256,
    )  # fmt: skip
    torch.manual_seed(0)
    ring = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation=rh.ATTN_IMPLEMENTATION)
    ref = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="sdpa")
    ref.load_state_dict(ring.state_dict())
    ids = torch.randint(0, 128, (2, N), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "labels": ids.clone()}
    exact = ref(**batch).loss.item()  # float32, whole sequence
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = ring(**rh.shard_batch(batch, dist.group.WORLD, "zigzag", config=ring.config)).loss
        want = ref(**batch).loss
    dist.all_reduce(loss := loss.detach().float())
    return abs(loss.item() - exact), abs(want.item() - exact)


def test_transformers_llama_trains_under_autocast():
    pytest.importorskip("transformers", reason="ringflash.hf needs transformers (pip install '.[hf]')")
    try:
        ring_err, sdpa_err = run_ranks(_hf_autocast, 2, timeout_s=90)[0]
    except RankFailure as e:
        pytest.fail(f"the ranks failed under autocast: {e}")
    assert ring_err <= 2 * sdpa_err + 1e-3, (ring_err, sdpa_err)


def test_llama3_varlen_takes_autocast_inputs():
    # The all-gather drop-in builds its inputs inside the call (prepare): they are cast there too.
    from ringflash.ring_flash_attn import llama3_flash_attn_prepare_cu_seqlens, llama3_flash_attn_varlen_func

    q, k, v, _ = (t[0] for t in _inputs())  # (N, H, D) packed, one process; v bf16, q and k float32
    cu = torch.tensor([0, 20, N], dtype=torch.int32)
    cu_q, cu_k, max_q, max_k, k_slice = llama3_flash_attn_prepare_cu_seqlens(cu, True, 0, 1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        o = llama3_flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, 1, k_slice, causal=True)
    assert o.dtype == torch.bfloat16
    want = torch.cat([_sdpa(q[None, a:b].bfloat16(), k[None, a:b].bfloat16(), v[None, a:b])[0]
                      for a, b in ((0, 20), (20, N))])  # fmt: skip
    torch.testing.assert_close(o.float(), want.float(), atol=2e-2, rtol=2e-2)
