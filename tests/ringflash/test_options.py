"""Every option of the public entries means what it says: one a scheme cannot honour raises, naming it.

`transport` is the ring's (how its blocks travel between neighbours), `heads_k_stride` the
all-gather's (K/V heads per gather): each is checked (type, range, name) on every path and
refused on the scheme that cannot use it, by the functional call (alone and inside the head-
parallel hybrid), the module and `ringflash.hf`'s context; a refusal on one rank raises on every
rank, and the group still runs a correct call afterwards.
"""

from __future__ import annotations

import re

import pytest
import torch

import ringflash
from ringflash import RingFlashAttention, ring_flash_attn_func
from tests.dist_utils import run_ranks
from tests.truth import TOL, attention_f64, rel_err

REJECTED = (
    r"(ring|hybrid) attention: rank\(s\) \[{}\] of the group rejected their inputs \(see the error raised "
    r"there\); every rank raises so that none waits for them"
)
STRIDE_ON_RING = (
    r"heads_k_stride=2: scheme='ring' passes whole K/V blocks and cannot use it; it sets scheme='allgather''s K/V "
    r"heads per gather \(leave it at 1 for the ring\)"
)
TRANSPORT_ON_GATHER = (
    r"transport='nccl': scheme='allgather' gathers K/V with the group's collectives and cannot use it; it sets how "
    r"scheme='ring' passes blocks between neighbours \(leave it None for the all-gather\)"
)
BAD_STRIDE = r"heads_k_stride must be a positive int \(K/V heads per gather\), got {}"
BAD_TRANSPORT = r"transport must be one of \('nccl', 'copy-engine'\) or None, got 'bogus'"


def _inputs(rank, world):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 8 * world, 2, 16, generator=g) for _ in range(3))
    return q, k, v, [ringflash.shard(t, 1, rank, world) for t in (q, k, v)]


def _worker(rank, world, scheme, hybrid, option, value, on_rank):
    q, k, v, local = _inputs(rank, world)
    base = dict(causal=True, scheme=scheme)
    if hybrid:  # u = 2 head ranks around rings of one: the hybrid's grid check runs the option checks
        ring_g, head_g = ringflash.hybrid_groups(world)
        base |= dict(group=ring_g, head_group=head_g)
        local = [ringflash.shard(t, 1, 0, 1, head_rank=rank, head_world=world) for t in (q, k, v)]
    kw = dict(base)
    if on_rank is None or rank == on_rank:
        kw[option] = value
    try:
        ring_flash_attn_func(*local, **kw)
        got = None
    except (TypeError, ValueError) as e:
        got = str(e)
    # Nothing was left in flight: the same groups still run a correct call of this scheme.
    o = ring_flash_attn_func(*local, **base)
    truth = attention_f64(q, k, v, True)["o"]
    want = (ringflash.shard(truth, 1, 0, 1, head_rank=rank, head_world=world) if hybrid
            else ringflash.shard(truth, 1, rank, world))  # fmt: skip
    assert rel_err(o, want) < TOL[torch.float32]
    return got


@pytest.mark.parametrize(
    "scheme, hybrid, option, value, on_rank, mine",
    [
        ("ring", False, "heads_k_stride", 2, 1, STRIDE_ON_RING),
        ("ring", False, "transport", "bogus", 1, BAD_TRANSPORT),
        ("ring", False, "heads_k_stride", 0, None, BAD_STRIDE.format(0)),
        ("ring", False, "heads_k_stride", -5, 0, BAD_STRIDE.format(-5)),
        ("ring", False, "heads_k_stride", 2.0, 1, BAD_STRIDE.format(2.0)),
        ("ring", True, "heads_k_stride", 2, 1, STRIDE_ON_RING),
        ("allgather", False, "transport", "nccl", 1, TRANSPORT_ON_GATHER),
        ("allgather", False, "transport", "bogus", 0, BAD_TRANSPORT),
        ("allgather", False, "transport", "copy-engine", None, TRANSPORT_ON_GATHER.replace("nccl", "copy-engine")),
        ("allgather", True, "transport", "nccl", 0, TRANSPORT_ON_GATHER),
        ("allgather", False, "heads_k_stride", True, 1, BAD_STRIDE.format(True)),
    ],
)
def test_an_option_the_scheme_cannot_honour_raises_on_every_rank(scheme, hybrid, option, value, on_rank, mine):
    msgs = run_ranks(_worker, 2, (scheme, hybrid, option, value, on_rank))
    for rank, msg in enumerate(msgs):
        want = mine if on_rank in (None, rank) else REJECTED.format(on_rank)
        assert msg is not None and re.fullmatch(want, msg), (rank, msg)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(heads_k_stride=2), STRIDE_ON_RING),
        (dict(heads_k_stride=0, scheme="allgather"), BAD_STRIDE.format(0)),
        (dict(transport="nccl", scheme="allgather"), TRANSPORT_ON_GATHER),
        (dict(transport="bogus", scheme="allgather"), BAD_TRANSPORT),
    ],
)
def test_module_and_hf_context_refuse_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=f"^{match}$"):
        RingFlashAttention(**kwargs)
    rh = pytest.importorskip("ringflash.hf")
    with pytest.raises(ValueError, match=f"^{match}$"):
        rh.RingContext(**kwargs)
    with pytest.raises(ValueError, match=f"^{match}$"), rh.context_parallel(**kwargs):
        pass


def test_each_scheme_keeps_its_own_option():
    # What each scheme does use still goes through, on one process.
    q, k, v, _ = _inputs(0, 1)
    truth = attention_f64(q, k, v, True)["o"]
    for kwargs in (dict(scheme="allgather", heads_k_stride=2), dict(scheme="ring", transport="nccl")):
        assert rel_err(RingFlashAttention(**kwargs)(q, k, v), truth) < TOL[torch.float32], kwargs
        assert rel_err(ring_flash_attn_func(q, k, v, causal=True, **kwargs), truth) < TOL[torch.float32], kwargs


def test_the_module_settles_its_options_once():
    # The module makes its CallOptions once, frozen, and each forward hands that object to the
    # scheme: what it runs is what it was built with, and the same as the functional call.
    import dataclasses

    from ringflash.api import CallOptions

    attn = RingFlashAttention(causal=True, scheme="allgather", heads_k_stride=2, softcap=3.0, window_size=(4, 0))
    assert attn.options == CallOptions(scheme="allgather", layout="zigzag", heads_k_stride=2, softcap=3.0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        attn.options.softcap = 0.0
    with pytest.raises(ValueError, match=r"^softcap must be >= 0 and finite \(0.0: none\), got -1.0$"):
        CallOptions(softcap=-1.0).check()
    q, k, v, _ = _inputs(0, 1)
    want = ring_flash_attn_func(q, k, v, causal=True, window_size=(4, 0), scheme="allgather", heads_k_stride=2,
                                softcap=3.0)  # fmt: skip
    assert torch.equal(attn(q, k, v), want)
    assert "scheme='allgather'" in repr(attn) and "window_size=(4, 0)" in repr(attn) and "softcap=3.0" in repr(attn)
