"""ringflash.layout: sharding round trips, global positions, and the ring schedule's exactness."""

import pytest
import torch

from ringflash import layout as L
from ringflash.kernels import CAUSAL, FULL

WORLDS = [1, 2, 3, 4]


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("name", L.LAYOUTS)
@pytest.mark.parametrize("dim", [0, 1, -1])
def test_shard_unshard_round_trip(world, name, dim):
    x = torch.randn(4 * world, 4 * world, 4 * world)
    shards = [L.shard(x, dim, r, world, name) for r in range(world)]
    assert all(s.shape[dim] == x.shape[dim] // world for s in shards)
    assert torch.equal(L.unshard(shards, dim, name), x)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("name", L.LAYOUTS)
def test_global_positions_match_shard_of_arange(world, name):
    n = 6 * world
    for r in range(world):
        pos = L.global_positions(n // world, r, world, name)
        assert pos.dtype == torch.int64
        assert torch.equal(pos, L.shard(torch.arange(n), 0, r, world, name))
        assert bool((pos[1:] > pos[:-1]).all()), "local order must be global order (causal diagonal)"


def test_zigzag_chunks():
    # 2W chunks; rank r holds r and 2W-1-r.
    assert [L.chunk_ids(r, 4, "zigzag") for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    assert L.global_positions(4, 1, 2, "zigzag").tolist() == [2, 3, 4, 5]
    assert L.global_positions(4, 0, 2, "zigzag").tolist() == [0, 1, 6, 7]


def test_stripe_puts_token_t_on_rank_t_mod_w():
    assert L.global_positions(3, 1, 4, "stripe").tolist() == [1, 5, 9]
    x = torch.arange(24.0).view(2, 12)
    assert L.shard(x, 1, 2, 4, "stripe").tolist() == [[2, 6, 10], [14, 18, 22]]
    assert L.shard(x, -1, 2, 4, "stripe").is_contiguous()
    assert L.local_chunks(4, "stripe") == 1 and L.local_chunks(4, "zigzag") == 2
    with pytest.raises(ValueError, match="multiple of 4"):
        L.shard(torch.zeros(10), 0, 0, 4, "stripe")
    with pytest.raises(ValueError, match="chunk_ids: the stripe layout holds single tokens"):
        L.chunk_ids(0, 2, "stripe")


@pytest.mark.parametrize("world", [2, 3, 4])
def test_stripe_causal_steps_are_whole_diagonals(world):
    # A key block from a lower rank is the causal diagonal; from a higher rank, the diagonal
    # shifted by one (query rows 1.. against key rows ..n-1): every rank does the same work.
    n = 5
    for r in range(world):
        steps = L.ring_schedule(r, world, n, True, "stripe")
        for s, step in enumerate(steps):
            j = (r - s) % world
            shifted = L.Step(slice(1, n), slice(0, n - 1), CAUSAL)
            assert step == (L.Step(slice(0, n), slice(0, n), CAUSAL) if j <= r else shifted)
    assert L.ring_schedule(0, 2, 1, True, "stripe")[1] is None  # one row, nothing strictly before it


def test_check_splittable_messages():
    L.check_splittable(12, 3, "contiguous")
    L.check_splittable(7, 1, "zigzag")  # one rank: any length
    with pytest.raises(ValueError, match=r"multiple of 6.*seqlen=9.*pad to 12"):
        L.check_splittable(9, 3, "zigzag")
    with pytest.raises(ValueError, match="multiple of 4"):
        L.check_splittable(10, 4, "contiguous")
    with pytest.raises(ValueError, match="layout must be one of"):
        L.check_splittable(8, 2, "ring")
    with pytest.raises(ValueError, match="world must be a positive int"):
        L.check_splittable(8, 0, "zigzag")
    with pytest.raises(ValueError, match="seqlen"):
        L.check_splittable(0, 2, "zigzag")
    with pytest.raises(ValueError, match="rank"):
        L.shard(torch.zeros(8), 0, 2, 2)
    with pytest.raises(ValueError, match="multiple of 4"):
        L.shard(torch.zeros(6), 0, 0, 2, "zigzag")
    with pytest.raises(ValueError, match="same size"):
        L.unshard([torch.zeros(4), torch.zeros(2)], 0)
    with pytest.raises(ValueError, match=r"dim must be an int in \[-3, 3\) for a 3-d tensor, got 5"):
        L.shard(torch.zeros(2, 8, 3), 5, 0, 2)
    with pytest.raises(ValueError, match=r"dim must be an int in \[-1, 1\)"):
        L.unshard([torch.zeros(4), torch.zeros(4)], 1)
    assert L.shard(torch.arange(8.0).view(1, 8), -1, 1, 2, "contiguous").tolist() == [[4, 5, 6, 7]]


def test_local_lengths_that_do_not_split_raise():
    # 5 local tokens cannot be zigzag's 2 equal chunks: an error, not positions, rows or a global
    # tensor silently cut to the wrong size.
    with pytest.raises(ValueError, match="multiple of 4"):
        L.global_positions(5, 0, 2, "zigzag")
    with pytest.raises(ValueError, match="multiple of 4"):
        L.ring_schedule(0, 2, 5, True, "zigzag")
    with pytest.raises(ValueError, match="5 rows along dim 1, not divisible into its 2 chunks"):
        L.unshard([torch.randn(2, 5), torch.randn(2, 5)], 1, "zigzag")


def _visible(q_pos, k_pos, causal):
    return (k_pos[None, :] <= q_pos[:, None]) if causal else torch.ones(len(q_pos), len(k_pos), dtype=torch.bool)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("name", L.LAYOUTS)
@pytest.mark.parametrize("causal", [False, True])
def test_schedule_covers_exactly_the_visible_pairs(world, name, causal):
    # For every rank and step, the step's (q rows, kv rows, causal) must cover exactly the
    # (query, key) pairs the global mask allows: nothing missed, nothing masked computed.
    n = 4
    for r in range(world):
        q_pos = L.global_positions(n, r, world, name)
        for s, step in enumerate(L.ring_schedule(r, world, n, causal, name)):
            k_pos = L.global_positions(n, (r - s) % world, world, name)
            want = _visible(q_pos, k_pos, causal)
            got = torch.zeros_like(want)
            if step is not None:
                block = torch.ones(n, n, dtype=torch.bool)[step.q, step.kv]
                got[step.q, step.kv] = block.tril() if step.spec.causal else block
                # Only the diagonal block is masked, but for stripe, whose every step is a diagonal.
                assert not step.spec.causal or s == 0 or name == "stripe"
            assert torch.equal(got, want), f"rank {r} step {s}: {step}"


@pytest.mark.parametrize("world", [2, 3, 4])
def test_zigzag_causal_is_balanced_half_blocks(world):
    # The zigzag schedule: j < r -> all Q vs first KV chunk; j > r -> second Q chunk vs all KV; every step
    # after the first is half a block pair on every rank.
    n, h = 8, 4
    for r in range(world):
        steps = L.ring_schedule(r, world, n, True, "zigzag")
        assert steps[0] == L.Step(slice(0, n), slice(0, n), CAUSAL)
        for s in range(1, world):
            j = (r - s) % world
            want = L.Step(slice(0, n), slice(0, h), FULL) if j < r else L.Step(slice(h, n), slice(0, n), FULL)
            assert steps[s] == want
            q_rows, kv_rows = steps[s].rows(n)
            assert q_rows * kv_rows == n * n // 2


def test_contiguous_causal_skips_later_blocks():
    steps = L.ring_schedule(1, 4, 8, True, "contiguous")
    # rank 1 sees kv from rank 0 (step 1) fully; ranks 3 and 2 (steps 2, 3) lie in its future.
    assert steps[1] == L.Step(slice(0, 8), slice(0, 8), FULL)
    assert steps[2] is None and steps[3] is None
