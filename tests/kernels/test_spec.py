"""kernels/spec.py: flash_attn's `window_size` converted into an `AttnSpec` means what flash_attn
means by it, converts back, and is refused by name; `mask_kind` is the spec's kind."""

from __future__ import annotations

import itertools

import pytest
import torch

from ringflash.kernels import AttnSpec, mask_kind

N = 9
PAIRS = [(-1, -1), (-1, 0), (0, 0), (3, 0), (3, -1), (0, 2), (2, 3), (-1, 2), (4, -1), (20, 20)]


def flash_allowed(left: int, right: int, causal: bool) -> torch.Tensor:
    """flash_attn's definition, written out: key j is visible from query i iff
    i − left <= j <= i + right (−1: no limit on that side), and j <= i with causal."""
    i, j = torch.arange(N)[:, None], torch.arange(N)[None, :]
    ok = torch.ones(N, N, dtype=torch.bool)
    if left >= 0:
        ok &= j >= i - left
    if right >= 0:
        ok &= j <= i + right
    return ok & (j <= i) if causal else ok


def spec_allowed(spec: AttnSpec) -> torch.Tensor:
    q = torch.empty(1, N, 1, 1)
    vis = spec.intervals_for(q, q)
    j = torch.arange(N)[None, :]
    if vis is None:  # the dense masks
        return j <= torch.arange(N)[:, None] if spec.causal else torch.ones(N, N, dtype=torch.bool)
    return (j >= vis.kv_lo[0][:, None].long()) & (j < vis.kv_hi[0][:, None].long())


@pytest.mark.parametrize(("pair", "causal"), [(p, c) for p, c in itertools.product(PAIRS, (False, True))
                                              if not (c and p[1] > 0)])  # fmt: skip
def test_window_size_means_flash_attns_window(pair, causal):
    spec = AttnSpec.from_window_size(pair, causal=causal)
    assert spec.causal is causal
    assert torch.equal(spec_allowed(spec), flash_allowed(*pair, causal))
    back = AttnSpec.from_window_size(spec.window_size, causal=causal)
    assert back == spec, f"{pair} -> {spec} -> {spec.window_size} -> {back}"


def test_causal_window_forms():
    assert AttnSpec.from_window_size((4, 0), causal=True) == AttnSpec(causal=True, window=5)
    assert AttnSpec(causal=True, window=5).window == AttnSpec(causal=True, window=(4, -1)).window == (4, 0)
    assert AttnSpec(causal=True, window=(-1, 0)).window is None and AttnSpec(window=(-1, -1)).window is None
    assert AttnSpec(causal=True, window=5).window_size == (4, 0)
    assert AttnSpec(window=(2, 3)).window_size == (2, 3)
    assert AttnSpec(causal=True).window_size == (-1, -1)


@pytest.mark.parametrize(
    ("pair", "causal", "exc", "match"),
    [
        ((3,), False, TypeError, r"window_size must be a pair of ints \(left, right\), got \(3,\)"),
        ((True, 0), True, TypeError, "window_size must be a pair of ints"),
        ((2.0, 0), True, TypeError, "window_size must be a pair of ints"),
        ((-2, 0), False, ValueError, r"window_size=\(-2, 0\): entries must be >= 0, or -1 for no limit"),
        ((3, 1), True, ValueError, r"window_size=\(3, 1\) with causal=True: a causal window has no keys to the right"),
        ((3, 0), 1, TypeError, "causal must be a bool"),
    ],
)
def test_bad_window_size_is_named(pair, causal, exc, match):
    with pytest.raises(exc, match=match):
        AttnSpec.from_window_size(pair, causal=causal)


def test_mask_kind_is_the_specs_kind():
    for spec in (AttnSpec(), AttnSpec(causal=True), AttnSpec(causal=True, window=3), AttnSpec(window=(1, 2))):
        assert mask_kind(causal=spec.causal, window=spec.window) == spec.kind
    assert mask_kind(causal=True, window=4, intervals=True) == "intervals"
