"""The cross-rank agreement check (ringflash/agree.py): every field of the row is compared, and a
mismatch is reported with the field's name and each rank's value, decoded (names, not numbers).

No process group: a stub comm's `all_gather_ints` returns the rows the other ranks would send
(tests/ringflash/test_agree.py runs the check for real over gloo ranks).
"""

from __future__ import annotations

import math
import re

import pytest
import torch

from ringflash import agree

# The call every rank makes unless a case changes one argument on one rank.
BASE = dict(causal=True, softmax_scale=0.125, layout="zigzag", window_size=(-1, -1), mask_key=0, transport="nccl")


class _Ranks:
    """A comm of global ranks 0..n whose all_gather returns this rank's row and prepared others."""

    group = None

    def __init__(self, *others):
        self.others = others
        self.world = 1 + len(others)

    def all_gather_ints(self, row):
        assert len(row) == agree.WIDTH
        return [list(row), *(list(r) for r in self.others)]


def _qk(dtype=torch.float32, hkv=2):
    g = torch.Generator().manual_seed(0)
    return torch.randn(1, 8, 4, 16, generator=g).to(dtype), torch.randn(1, 8, hkv, 16, generator=g).to(dtype)


def _row(ok=True, dtype=torch.float32, hkv=2, call="ring attention", world=3, heads=1, **changes):
    q, k = _qk(dtype, hkv)
    return agree.row(ok, call, world, heads, q=q, k=k, **{**BASE, **changes})


@pytest.mark.parametrize(
    ("other", "report"),
    [
        (dict(hkv=1), "k.shape is (1, 8, 2, 16) on ranks 0-1, (1, 8, 1, 16) on rank 2"),
        (dict(dtype=torch.bfloat16), "dtype is torch.float32 on ranks 0-1, torch.bfloat16 on rank 2"),
        (dict(layout="contiguous"), "layout is zigzag on ranks 0-1, contiguous on rank 2"),
        (dict(causal=False), "causal is True on ranks 0-1, False on rank 2"),
        # the last bit of a float64: the scale travels exactly, and is reported as a number
        (dict(softmax_scale=math.nextafter(0.125, 1.0)),
         "softmax_scale is 0.125 on ranks 0-1, 0.12500000000000003 on rank 2"),
        (dict(window_size=(3, 0)), "window_size is (-1, -1) on ranks 0-1, (3, 0) on rank 2"),
        (dict(mask_key=255), "the mask (documents, window or layout given to ring_mask) is none on ranks 0-1, "
                             "00000000000000ff on rank 2"),
        (dict(transport="copy-engine"), "transport is nccl on ranks 0-1, copy-engine on rank 2"),
        (dict(call="hybrid attention", world=2, heads=2),
         "call is ring attention over 3 rank(s) on ranks 0-1, "
         "hybrid attention (u = 2 head × r = 2 ring ranks) on rank 2"),
    ],
    ids=["k-shape", "dtype", "layout", "causal", "scale", "window", "mask", "transport", "call"],
)  # fmt: skip
def test_mismatch_names_the_field_and_every_rank(other, report):
    # Three ranks, the last one different: a check of ranks 0 and 1 alone would miss it.
    with pytest.raises(ValueError, match="ring attention inputs differ between the ranks of the group: "
                                         + re.escape(report)):  # fmt: skip
        agree.check(_Ranks(_row(), _row(**other)), _row())


def test_rows_have_one_length_whatever_the_call():
    q, _ = _qk()
    rows = [
        _row(),
        _row(call="hybrid attention", world=2, heads=2),
        agree.row(False, "ring attention", 2, q=q[0], k=None, causal=True, layout="zigzag"),  # a rejection
        agree.row(True, "shard_batch", 2, batch={"input_ids": torch.arange(8).view(2, 4)}),
    ]
    assert {len(r) for r in rows} == {agree.WIDTH}


def test_a_rank_in_another_call_is_named():
    # One rank's model ran without the ring and went on to the next batch (the transformers pitfall).
    other = agree.row(True, "shard_batch", 3, batch={"input_ids": torch.arange(8).view(2, 4)})
    with pytest.raises(ValueError, match=r"call is .* shard_batch over 3 rank\(s\) on rank 2 .*did not enter"):
        agree.check(_Ranks(_row(), other), _row())


def test_rejected_rank_is_named():
    q, k = _qk()
    rejected = agree.row(False, "ring attention", 3, q=q[0], k=k, causal=True, layout="zigzag")  # announce's row
    with pytest.raises(ValueError, match=r"rank\(s\) \[2\] of the group rejected their inputs"):
        agree.check(_Ranks(_row(), rejected), _row())


def test_equal_rows_pass():
    agree.check(_Ranks(_row(), _row()), _row())
    agree.check(_Ranks(_row(window_size=(3, 0)), _row(window_size=(3, 0))), _row(window_size=(3, 0)))


def test_batch_digest_sees_values_not_only_shapes():
    ids = torch.arange(96).view(2, 48)
    other = ids.clone()
    other[1, 7] += 1
    assert agree.digest(ids) == agree.digest(ids.clone()) != agree.digest(other)
    assert agree.digest(ids) != agree.digest(ids.to(torch.int32))  # same values, other dtype
    mine = agree.row(True, "shard_batch", 2, batch={"input_ids": ids})
    theirs = agree.row(True, "shard_batch", 2, batch={"input_ids": other})
    with pytest.raises(ValueError, match=r"batch\['input_ids'\] \(digest\) is [0-9a-f]{16} on rank 0, [0-9a-f]{16} on"):
        agree.check(_Ranks(theirs), mine)
