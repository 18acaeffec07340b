"""The transformer on its own: shapes, causality, RoPE on explicit positions, GQA, size."""

from __future__ import annotations

import pytest
import torch

from ringflash.train.config import ModelConfig, load_config
from ringflash.train.model import DocumentMask, LocalCausalAttention, Transformer, apply_rope, rope_angles
from tests.dist_utils import REPO

TINY = ModelConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2)


def model(cfg: ModelConfig = TINY) -> Transformer:
    torch.manual_seed(0)
    return Transformer(cfg).double()


def test_shapes_and_default_positions():
    m = model()
    idx = torch.randint(0, 256, (2, 24))
    logits = m(idx)
    assert logits.shape == (2, 24, 256)
    torch.testing.assert_close(logits, m(idx, torch.arange(24)))


@pytest.mark.parametrize("n_kv_heads", [1, 2, 4])
def test_causal(n_kv_heads):
    m = model(ModelConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=n_kv_heads))
    idx = torch.randint(0, 256, (1, 32))
    changed = idx.clone()
    changed[0, 20:] = (changed[0, 20:] + 1) % 256
    a, b = m(idx), m(changed)
    torch.testing.assert_close(a[:, :20], b[:, :20])
    assert not torch.allclose(a[:, 20:], b[:, 20:])


def test_rope_depends_only_on_relative_position():
    # Shifting every position by the same offset must not change attention, so not the logits:
    # this is why a cp rank may rotate its shard by global positions and still match cp = 1.
    m = model()
    idx = torch.randint(0, 256, (2, 16))
    torch.testing.assert_close(m(idx, torch.arange(16)), m(idx, torch.arange(16) + 1000))


def test_rope_positions_matter():
    m = model()
    idx = torch.randint(0, 256, (1, 16))
    shuffled = torch.arange(16).flip(0)
    assert not torch.allclose(m(idx), m(idx, shuffled))


def test_rope_rotation_preserves_norm_and_matches_complex_form():
    x = torch.randn(2, 5, 3, 8, dtype=torch.float64)
    pos = torch.tensor([0, 3, 7, 100, 70000])
    cos, sin = rope_angles(pos, 8, 10000.0)
    y = apply_rope(x, cos, sin)
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1))
    z = torch.view_as_complex(x.unflatten(-1, (-1, 2)).contiguous())
    rot = torch.polar(torch.ones_like(cos, dtype=torch.float64), torch.atan2(sin, cos).double())
    expected = torch.view_as_real(z * rot[None, :, None, :]).flatten(-2)
    torch.testing.assert_close(y, expected, atol=1e-6, rtol=1e-6)  # angles come back as float32


def test_tied_embedding_and_param_count():
    m = model()
    assert m.lm_head.weight is m.tok_emb.weight
    assert m.num_params() == sum(p.numel() for p in m.parameters())
    assert m.num_params(exclude_embedding=True) == m.num_params() - 256 * 64


def test_gpu_config_is_about_100m_params():

    cfg = load_config(REPO / "configs" / "gpu1.toml")
    with torch.device("meta"):
        n = Transformer(cfg.model).num_params()
    assert 80e6 < n < 130e6, n


def test_swappable_attention_core():
    m = model()
    calls = []

    class Spy(torch.nn.Module):
        def forward(self, q, k, v):
            calls.append((q.shape, k.shape))
            return torch.zeros_like(q)

    for block in m.blocks:
        block.attn.core = Spy()
    m(torch.randint(0, 256, (2, 8)))
    assert calls == [((2, 8, 4, 16), (2, 8, 2, 16))] * 2


def test_mask_reaches_every_core_unopened():
    m = model()
    seen, token = [], object()

    class Spy(torch.nn.Module):
        def forward(self, q, k, v, mask=None):
            seen.append(mask)
            return torch.zeros_like(q)

    for block in m.blocks:
        block.attn.core = Spy()
    m(torch.randint(0, 256, (2, 8)), mask=token)
    assert seen == [token, token]


def test_document_mask_isolates_documents():
    # Two documents (11 and 13 tokens); a different first document must not move the second's logits.
    m = model()
    doc_ids = torch.tensor([[0] * 11 + [1] * 13])
    a = torch.randint(0, 256, (1, 24))
    b = a.clone()
    b[0, :11] = torch.randint(0, 256, (11,))
    la, lb = m(a, mask=DocumentMask(doc_ids)), m(b, mask=DocumentMask(doc_ids))
    torch.testing.assert_close(la[:, 11:], lb[:, 11:])
    assert not torch.allclose(m(a)[:, 11:], m(b)[:, 11:])  # without the mask they do see each other
    # The second document alone, at the same positions, gives the same logits.
    torch.testing.assert_close(la[:, 11:], m(a[:, 11:], torch.arange(11, 24)))
    with pytest.raises(TypeError, match=r"mask: LocalCausalAttention takes a train.model.DocumentMask"):
        m(a, mask="not a mask")


def test_sliding_window():
    # With window w and 2 layers, token i depends on tokens i - 2(w - 1) .. i only.
    w = 4
    m = model(ModelConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, window=w))
    idx = torch.randint(0, 256, (1, 32))
    changed = idx.clone()
    changed[0, :10] = (changed[0, :10] + 1) % 256
    a, b = m(idx), m(changed)
    torch.testing.assert_close(a[:, 10 + 2 * (w - 1) :], b[:, 10 + 2 * (w - 1) :])
    assert not torch.allclose(a[:, 10 : 10 + 2 * (w - 1)], b[:, 10 : 10 + 2 * (w - 1)])
    full = model()  # the same weights (same seed) without a window see everything
    assert not torch.allclose(full(idx)[:, 20:], full(changed)[:, 20:])


def test_rope_angles_are_position_times_standard_frequencies():
    # theta^(-2i/D) for D = 8, theta = 1e4: 1, 0.1, 0.01, 0.001 (the standard RoPE frequencies,
    # which checkpoints and the ring's global positions assume). At positions ~1e6 the product
    # must be taken in float64: float32 angles would be off by ~1e-2 rad in the second pair.
    pos = torch.tensor([0, 1, 7, 1_000_003, 3_000_017])
    cos, sin = rope_angles(pos, 8, 10000.0)
    angles = pos.double()[:, None] * torch.tensor([1.0, 0.1, 0.01, 0.001], dtype=torch.float64)
    assert cos.dtype == sin.dtype == torch.float32 and cos.shape == (5, 4)
    torch.testing.assert_close(cos, angles.cos().float(), atol=1e-6, rtol=0)
    torch.testing.assert_close(sin, angles.sin().float(), atol=1e-6, rtol=0)


def local_attention_f64(q, k, v, window, doc):
    """Float64 softmax attention, query head h on key/value head h // (H/Hkv) (the kernels' GQA
    grouping), key j visible to query i iff j <= i, i - j < window (None: no window), same document."""
    H, Hkv, N = q.shape[2], k.shape[2], q.shape[1]
    kr, vr = (t.double().repeat_interleave(H // Hkv, dim=2) for t in (k, v))
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), kr) / q.shape[-1] ** 0.5
    i = torch.arange(N)
    allowed = (i[:, None] >= i[None, :])[None]
    if window:
        allowed = allowed & (i[:, None] - i[None, :] < window)
    if doc is not None:
        allowed = allowed & (doc[:, :, None] == doc[:, None, :])
    s = s.masked_fill(~allowed[:, None], float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), vr)


@pytest.mark.parametrize("n_kv_heads", [1, 2, 4])
@pytest.mark.parametrize("window, docs", [(None, False), (5, False), (None, True), (5, True)])
def test_local_attention_matches_float64(n_kv_heads, window, docs):
    # The default core against explicit float64 attention: GQA heads grouped as the ring's kernels
    # group them (so cp = 1 and cp > 1 run the same model), window and documents combined.
    g = torch.Generator().manual_seed(0)
    B, N, H, D = 2, 20, 4, 8
    q = torch.randn(B, N, H, D, generator=g, dtype=torch.float64)
    k, v = (torch.randn(B, N, n_kv_heads, D, generator=g, dtype=torch.float64) for _ in range(2))
    doc = torch.tensor([[0] * 7 + [1] * 3 + [2] * 10, [0] * 13 + [1] * 7]) if docs else None
    got = LocalCausalAttention(window)(q, k, v, mask=DocumentMask(doc) if docs else None)
    torch.testing.assert_close(got, local_attention_f64(q, k, v, window, doc))
