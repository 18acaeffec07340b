"""`train.recompute_attention = false`: activation checkpointing keeps attention's outputs (a
selective policy on ringflash's ops) instead of running the ring again in the backward.

The same losses and weights as recomputing it, for ringflash's model and a transformers Llama, DDP
and FSDP2 (the kept outputs are the numbers the recompute would give), and each step runs each
layer's ring forward once where recomputing runs it twice.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.dist_utils import run_ranks
from tests.tiny_config import tiny_config
from tests.train.test_parity import MODELS

STEPS = 3
LAYERS = 2  # tiny_config's, and the transformers Llama's (MODELS["llama"])
RUN = [f"--train.steps={STEPS}", "--train.warmup_steps=1", "--data.passkey_loss=all", "--parallel.cp=2",
       "--checkpoint.enabled=false", "--train.activation_checkpointing=true",
       f"--logging.log_every={STEPS}"]  # fmt: skip


def _train(rank, world, overrides):
    """(step -> loss, final weights on rank 0, ring forwards run on this rank)."""
    from torch.distributed.tensor import DTensor

    from ringflash import ops
    from ringflash.train.trainer import train

    real, calls = ops.ring_forward, []

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    ops.ring_forward = counting  # the ring op and its eager twin both call ops.ring_forward
    try:
        result = train(tiny_config(None, *RUN, *overrides))
    finally:
        ops.ring_forward = real
    weights = {n: p.full_tensor() if isinstance(p, DTensor) else p for n, p in result.model.named_parameters()}
    weights = {n: w.detach().numpy().copy() for n, w in weights.items()} if rank == 0 else None
    return result.losses, weights, len(calls)


@pytest.mark.parametrize("fsdp", [False, True], ids=["ddp", "fsdp2"])
@pytest.mark.parametrize("model", ["ringflash", "llama"])
def test_kept_attention_trains_as_recomputed_with_one_ring_forward_a_layer(model, fsdp):
    if model != "ringflash":
        pytest.importorskip("transformers", reason="model.kind = hf needs transformers (pip install '.[hf]')")
    runs = {}
    for recompute in (True, False):
        overrides = (*MODELS[model], f"--parallel.fsdp={str(fsdp).lower()}",
                     f"--train.recompute_attention={str(recompute).lower()}")  # fmt: skip
        runs[recompute] = run_ranks(_train, 2, args=(overrides,), timeout_s=90)
    (losses, weights, calls), (kept_losses, kept_weights, kept_calls) = runs[True][0], runs[False][0]
    assert sorted(kept_losses) == sorted(losses) == list(range(1, STEPS + 1))
    for step, loss in losses.items():
        assert kept_losses[step] == pytest.approx(loss, rel=1e-6), step
    for name, w in weights.items():
        np.testing.assert_allclose(kept_weights[name], w, rtol=1e-5, atol=1e-7, err_msg=name)
    assert calls == 2 * STEPS * LAYERS  # the forward's, and the backward's recompute
    assert kept_calls == STEPS * LAYERS == runs[False][1][2]  # the forward's alone, on both ranks


def test_the_memory_prediction_counts_the_kept_outputs():
    from ringflash.train.memory import kept_attention_bytes_per_token, predict

    cfg = tiny_config(None).model  # dim 32, 2 heads of 16, 1 K/V head, 2 layers
    assert kept_attention_bytes_per_token(cfg, "bfloat16", 1) == 2 * 16 * 2 + 4 * 2
    assert kept_attention_bytes_per_token(cfg, "bfloat16", 2) == 2 * 16 * 2 + 4 * 2 + 2 * 16 * 2
    kept = predict(cfg, 4096, cp=2, activation_checkpointing=True, recompute_attention=False)
    recomputed = predict(cfg, 4096, cp=2, activation_checkpointing=True)
    assert kept["activations"] - recomputed["activations"] == 2048 * 2 * kept_attention_bytes_per_token(
        cfg, "bfloat16", 2)
    assert predict(cfg, 4096, cp=2, recompute_attention=False) == predict(cfg, 4096, cp=2)  # nothing checkpointed


def test_a_users_own_checkpointing_keeps_the_ring_output(monkeypatch):
    """`context_fn=ringflash.ops.keep_attention_outputs` in a user's own checkpointed block (one
    process): one ring forward instead of two, and the gradients of plain checkpointing."""
    import torch
    from torch.utils.checkpoint import checkpoint

    import ringflash
    from ringflash import ops

    calls, real = [], ops.ring_forward
    monkeypatch.setattr(ops, "ring_forward", lambda *a, **k: calls.append(1) or real(*a, **k))
    torch.manual_seed(0)
    proj, x = torch.nn.Linear(32, 96), torch.randn(2, 64, 32)

    def block(x):
        q, k, v = proj(x).view(2, 64, 3, 4, 8).unbind(2)
        return ringflash.ring_flash_attn_func(q, k, v, causal=True).square().sum()

    grads = []
    for context_fn in (None, ops.keep_attention_outputs):
        calls.clear()
        proj.zero_grad()
        kwargs = {} if context_fn is None else {"context_fn": context_fn}
        checkpoint(block, x, use_reentrant=False, **kwargs).backward()
        grads.append((proj.weight.grad.clone(), len(calls)))
    (plain, plain_calls), (kept, kept_calls) = grads
    assert (plain_calls, kept_calls) == (2, 1)
    torch.testing.assert_close(kept, plain, rtol=1e-6, atol=1e-6)
