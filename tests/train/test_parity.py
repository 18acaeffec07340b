"""Loss parity, the test Megatron and TransformerEngine use for context parallelism: the same model
(ringflash's own, or transformers' Llama, Gemma 2, gpt-oss or DeepSeek-V3), data, seed and schedule
trained for 20 steps with the ring (cp = 2 and 4, DDP and FSDP2) give the
loss curve of one process on whole sequences, every step within 1e-5 relative (float32, CPU), and
the same weights after it, each tensor within 1e-4 of its norm.

The cp = 1 run is the oracle: one kernel call on whole sequences, no ring step to merge, no sharding
of tokens, labels or positions. Differences come only from the order of float32 sums (~2e-7 in the
loss, ~1e-6 in the weights, measured). The weights are checked too because a model this small
learns mostly byte frequencies in 20 steps, so its loss hardly depends on attention: a ring merge
whose block weights were off by 1% (lse difference + 0.01) moved the loss by 5e-7 but the weights
by 2.6e-4; one that dropped the other rank's block moved the loss by 1.4e-3.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

from tests.dist_utils import run_ranks
from tests.tiny_config import tiny_config

STEPS = 20
RTOL = 1e-5  # every step's loss, relative
WEIGHTS_RTOL = 1e-4  # every weight tensor after the last step, relative to its norm
# Loss on every token: the curve falls from the first step, so parity is of a model that learns.
PARITY = [f"--train.steps={STEPS}", "--train.warmup_steps=2", "--data.passkey_loss=all", "--checkpoint.enabled=false",
          f"--logging.log_every={STEPS}"]  # fmt: skip
HF = ["--model.kind=hf", "--model.hf.vocab_size=256", "--model.hf.hidden_size=32",
      "--model.hf.intermediate_size=64", "--model.hf.num_hidden_layers=2", "--model.hf.num_attention_heads=4",
      "--model.hf.num_key_value_heads=2"]  # fmt: skip
# Today's long-context families, each with what its attention adds, windows shorter than a rank's
# 128-token shard: Gemma 2 (softcap, sliding windows on alternate layers), gpt-oss (learnable
# sinks, alternate windows, mixture of experts), DeepSeek-V3 (MLA: q·k over 16 + 8, v over 16;
# experts from layer 2).
MODELS = {
    "ringflash": [],
    "llama": [*HF, "--model.hf.model_type=llama"],
    "gemma2": [*HF, "--model.hf.model_type=gemma2", "--model.hf.head_dim=16", "--model.hf.sliding_window=48",
               "--model.hf.attn_logit_softcapping=5.0", "--model.hf.final_logit_softcapping=30.0",
               "--model.hf.query_pre_attn_scalar=16"],
    "gpt_oss": [*HF, "--model.hf.model_type=gpt_oss", "--model.hf.head_dim=16", "--model.hf.sliding_window=48",
                "--model.hf.num_local_experts=4", "--model.hf.num_experts_per_tok=2"],
    "deepseek_v3": [*HF, "--model.hf.model_type=deepseek_v3", "--model.hf.num_key_value_heads=4",
                    "--model.hf.q_lora_rank=16", "--model.hf.kv_lora_rank=16", "--model.hf.qk_nope_head_dim=16",
                    "--model.hf.qk_rope_head_dim=8", "--model.hf.v_head_dim=16", "--model.hf.moe_intermediate_size=32",
                    "--model.hf.n_shared_experts=1", "--model.hf.n_routed_experts=4",
                    "--model.hf.num_experts_per_tok=2", "--model.hf.first_k_dense_replace=1", "--model.hf.n_group=1",
                    "--model.hf.topk_group=1"],
}  # fmt: skip


def _train(rank, world, overrides):
    """(step -> loss, name -> final weights as numpy) on rank 0; FSDP2's shards gathered on every rank."""
    from torch.distributed.tensor import DTensor

    from ringflash.train.trainer import train

    result = train(tiny_config(None, *PARITY, *overrides))
    weights = {n: p.full_tensor() if isinstance(p, DTensor) else p for n, p in result.model.named_parameters()}
    return result.losses, {n: w.detach().numpy().copy() for n, w in weights.items()} if rank == 0 else None


@functools.cache
def run(model: str, cp: int, fsdp: bool) -> tuple[dict[int, float], dict[str, np.ndarray]]:
    """The loss curve and final weights of `model` trained at dp = 1 × cp (one run per argument set)."""
    overrides = (*MODELS[model], f"--parallel.cp={cp}", f"--parallel.fsdp={str(fsdp).lower()}")
    return run_ranks(_train, cp, args=(overrides,), timeout_s=90)[0]


@pytest.mark.parametrize("fsdp", [False, True], ids=["ddp", "fsdp2"])
@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("model", sorted(MODELS))
def test_ring_loss_curve_equals_one_process(model, cp, fsdp):
    if model != "ringflash":
        pytest.importorskip("transformers", reason="model.kind = hf needs transformers (pip install '.[hf]')")
    (reference, ref_weights), (ring, weights) = run(model, 1, False), run(model, cp, fsdp)
    how = f"cp = {cp} ({'FSDP2' if fsdp else 'DDP'})"
    assert sorted(reference) == sorted(ring) == list(range(1, STEPS + 1))
    assert reference[STEPS] < 0.8 * reference[1], reference  # it learns: parity is not of a flat curve
    off = {s: abs(ring[s] - reference[s]) / reference[s] for s in reference}
    worst = max(off, key=off.get)
    assert off[worst] <= RTOL, (
        f"{how} leaves cp = 1's curve at step {worst}: {ring[worst]!r} against "
        f"{reference[worst]!r} ({off[worst]:.2e} relative > {RTOL:g})"
    )
    assert weights.keys() == ref_weights.keys()
    for name, w in ref_weights.items():
        gap = float(np.linalg.norm(weights[name] - w) / np.linalg.norm(w))
        assert gap <= WEIGHTS_RTOL, f"{how}: {name} after {STEPS} steps is {gap:.2e} of its norm from cp = 1's"
