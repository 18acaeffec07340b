"""ringflash.hf with today's long-context attention: Gemma 2 and Gemma 3 (logit softcapping,
sliding windows on alternate layers), gpt-oss (learnable sinks, sliding windows) and DeepSeek V2
and V3 (multi-head latent attention: a value head dim other than q's and k's) through the ring on 2
(DeepSeek: and 4) gloo ranks, and Gemma 2 and gpt-oss through the all-gather, equal the same
random-init tiny models with `attn_implementation="eager"` on the whole sequence: the loss and
every parameter's gradient."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="ringflash.hf needs transformers (pip install '.[hf]')")

import torch.distributed as dist  # noqa: E402

import ringflash.hf as rh  # noqa: E402
from tests.dist_utils import run_ranks  # noqa: E402

VOCAB, N = 128, 48
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=256, attention_dropout=0.0)  # fmt: skip


def tiny_config(kind: str):
    # Windows shorter than the sequence (and than a rank's shard) and caps that bend the scores.
    if kind == "gemma2":
        return transformers.Gemma2Config(**COMMON, sliding_window=7, attn_logit_softcapping=2.0,
                                         query_pre_attn_scalar=1, final_logit_softcapping=None)  # fmt: skip
    if kind == "gemma3":
        return transformers.Gemma3TextConfig(**COMMON, sliding_window=9, final_logit_softcapping=None,
                                             sliding_window_pattern=2)  # fmt: skip
    if kind in ("deepseek_v2", "deepseek_v3"):  # q·k over 16 + 8 (no RoPE + RoPE), v over 16; MoE from layer 2
        config = transformers.DeepseekV2Config if kind == "deepseek_v2" else transformers.DeepseekV3Config
        return config(
            **{k: v for k, v in COMMON.items() if k not in ("head_dim", "num_key_value_heads")},
            num_key_value_heads=4,  # MLA expands its latent to every head's K and V
            moe_intermediate_size=32,
            n_shared_experts=1,
            n_routed_experts=4,
            num_experts_per_tok=2,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
            kv_lora_rank=16,
            q_lora_rank=None,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
        )
    if kind == "gpt_oss":
        return transformers.GptOssConfig(
            **{**COMMON, "intermediate_size": 32},
            sliding_window=7,
            num_local_experts=4,
            num_experts_per_tok=2,
            layer_types=["sliding_attention", "full_attention"],
        )
    raise ValueError(kind)


@torch.no_grad()
def sharpen(model, kind: str) -> None:
    """Random-init scores are near 0, where c·tanh(s/c) ≈ s, and sinks near 0: make both matter.
    Gemma 3 normalises q (RMSNorm scaled by 1 + weight), the others get larger q projections.
    (Gemma 3's layers in this transformers pass no softcap to the attention, eager included: it is
    tested for its windows.)"""
    for layer in model.model.layers:
        attn = layer.self_attn
        if hasattr(attn, "q_norm"):
            attn.q_norm.weight.fill_(15.0)
        else:
            attn.q_proj.weight.mul_(30.0)
        if kind == "gpt_oss":
            attn.sinks.normal_(2.0, 1.0)


def _vs_eager(rank, world, kind, layout, scheme):
    cfg = tiny_config(kind)
    torch.manual_seed(0)
    ring = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation=rh.ATTN_IMPLEMENTATION)
    ref = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="eager")
    sharpen(ring, kind)
    ref.load_state_dict(ring.state_dict())
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (2, N), generator=g)
    batch = {"input_ids": ids, "labels": ids.clone()}
    with rh.context_parallel(dist.group.WORLD, layout, scheme=scheme):  # shard_batch takes the scheme from here
        shard = rh.shard_batch(batch, config=ring.config)
    assert shard["ring_masks"].context.scheme == scheme
    loss = ring(**shard).loss
    loss.backward()
    dist.all_reduce(loss := loss.detach())
    want = ref(**batch, use_cache=False).loss
    want.backward()
    torch.testing.assert_close(loss, want.detach(), rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(ring.named_parameters(), ref.parameters(), strict=True):
        if q.grad is None:  # an expert no token was routed to, on both sides
            assert p.grad is None or not p.grad.any(), name
            continue
        grad = p.grad.clone()
        dist.all_reduce(grad)  # cp ranks hold different tokens: their gradients add up
        torch.testing.assert_close(grad, q.grad, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    return float(loss)


@pytest.mark.parametrize(
    ("kind", "layout", "world", "scheme"),
    [("gemma2", "zigzag", 2, "ring"), ("gemma3", "contiguous", 2, "ring"), ("gpt_oss", "zigzag", 2, "ring"),
     ("deepseek_v3", "zigzag", 2, "ring"), ("deepseek_v3", "contiguous", 4, "ring"),
     ("deepseek_v2", "zigzag", 2, "ring"), ("gemma2", "contiguous", 2, "allgather"),
     ("gpt_oss", "zigzag", 4, "allgather")],
)  # fmt: skip
def test_matches_eager(kind, layout, world, scheme):
    losses = run_ranks(_vs_eager, world, (kind, layout, scheme), timeout_s=120)
    assert len(set(losses)) == 1


@pytest.mark.parametrize("kind", ["gemma2", "gpt_oss"])
def test_the_features_bite(kind):
    # Guards test_matches_eager against a softcap or sink both sides ignore: each moves the loss.
    cfg = tiny_config(kind)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    sharpen(model, kind)
    ids = torch.randint(0, VOCAB, (2, N), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        loss = model(input_ids=ids, labels=ids).loss
        for layer in model.model.layers:
            if kind == "gpt_oss":
                layer.self_attn.sinks.fill_(-1e4)  # a sink no row sees
            else:
                layer.self_attn.attn_logit_softcapping = None
        assert abs(model(input_ids=ids, labels=ids).loss - loss) > 1e-3
