"""The ring op's cross-rank check (ringflash/ops.py): every field of the signature is compared, and
a mismatch is reported with the field's name and each rank's value, decoded.

No process group: a stub comm's `all_gather_ints` returns the rows the other ranks would send
(tests/ringflash/test_ring.py runs the check for real over gloo ranks).
"""

from __future__ import annotations

import math
import re

import pytest
import torch

from ringflash.ops import _check_across_ranks, _signature

# The call every rank makes unless a case changes one argument on one rank.
BASE = dict(causal=True, scale=0.125, layout="zigzag", window=None, mask_key=0, transport="nccl")


class _Ranks:
    """A comm whose all_gather returns this rank's row followed by prepared rows of other ranks."""

    def __init__(self, *others):
        self.others = others

    def all_gather_ints(self, row):
        return [list(row), *(list(r) for r in self.others)]


def _qk(dtype=torch.float32, hkv=2):
    g = torch.Generator().manual_seed(0)
    return torch.randn(1, 8, 4, 16, generator=g).to(dtype), torch.randn(1, 8, hkv, 16, generator=g).to(dtype)


def _row(ok=True, dtype=torch.float32, hkv=2, **changes):
    q, k = _qk(dtype, hkv)
    a = {**BASE, **changes}
    return _signature(ok, q, k, a["causal"], a["scale"], a["layout"], a["window"], a["mask_key"], a["transport"])


@pytest.mark.parametrize(
    ("other", "report"),
    [
        (dict(hkv=1), "k.shape is (1, 8, 2, 16) on rank 0, (1, 8, 2, 16) on rank 1, (1, 8, 1, 16) on rank 2"),
        (dict(dtype=torch.bfloat16), "dtype is torch.float32 on rank 0, torch.float32 on rank 1, "
                                     "torch.bfloat16 on rank 2"),
        (dict(layout="contiguous"), "layout is zigzag on rank 0, zigzag on rank 1, contiguous on rank 2"),
        (dict(causal=False), "causal is True on rank 0, True on rank 1, False on rank 2"),
        # the last bit of a float64: the scale travels exactly, and is reported as a number
        (dict(scale=math.nextafter(0.125, 1.0)),
         "softmax_scale is 0.125 on rank 0, 0.125 on rank 1, 0.12500000000000003 on rank 2"),
        (dict(window=4), "window is None on rank 0, None on rank 1, 4 on rank 2"),
        (dict(mask_key=255), "the mask (documents, window or layout given to ring_mask) is none on rank 0, "
                             "none on rank 1, 00000000000000ff on rank 2"),
        (dict(transport="copy-engine"), "transport is nccl on rank 0, nccl on rank 1, copy-engine on rank 2"),
    ],
    ids=["k-shape", "dtype", "layout", "causal", "scale", "window", "mask", "transport"],
)
def test_mismatch_names_the_field_and_every_rank(other, report):
    # Three ranks, the last one different: a check of ranks 0 and 1 alone would miss it.
    with pytest.raises(ValueError, match="differ between the ranks of the group: " + re.escape(report) + "$"):
        _check_across_ranks(_Ranks(_row(), _row(**other)), _row())


def test_rejected_rank_is_named():
    q, k = _qk()
    rejected = _signature(False, q[0], k, True, None, "zigzag")  # what announce_rejection sends
    with pytest.raises(ValueError, match=r"rank\(s\) \[2\] of the group rejected their inputs"):
        _check_across_ranks(_Ranks(_row(), rejected), _row())


def test_equal_signatures_pass():
    _check_across_ranks(_Ranks(_row(), _row()), _row())
    _check_across_ranks(_Ranks(_row(window=4), _row(window=4)), _row(window=4))
