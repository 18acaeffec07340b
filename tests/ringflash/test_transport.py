"""The transports (ringflash/transport/): the factory, name resolution, the gloo ring, NullComm.

Multi-rank cases run fork-started gloo ranks (tests/dist_utils.py). The copy-engine transport
needs GPUs of one host with NCCL: launch/check_ring_nccl.py (the `multigpu` ring test) runs it;
here only its refusal of a gloo group is checked.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import ringflash
from ringflash.transport import (
    TRANSPORTS,
    CopyEngineComm,
    NullComm,
    RingComm,
    Transport,
    host_group,
    resolve_transport,
    ring_comm,
)
from tests.dist_utils import run_ranks

PACKAGE = Path(ringflash.transport.__file__).parent


# ---- the package stands alone ------------------------------------------------------------------


def _ringflash_imports(path: Path) -> set[str]:
    """The ringflash modules `path` imports, at top level or inside functions."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names |= {f"{node.module}.{a.name}" for a in node.names}
    return {n for n in names if n == "ringflash" or n.startswith("ringflash.")}


@pytest.mark.parametrize("path", sorted(PACKAGE.glob("*.py")), ids=lambda p: p.name)
def test_transport_imports_nothing_above_it(path):
    # The ring, the op and the API import the transports, never the other way round (no cycle).
    above = {"ringflash", "ringflash.ring", "ringflash.api", "ringflash.ops", "ringflash.masks"}
    imported = _ringflash_imports(path)
    assert not imported & above, f"{path.name} imports {sorted(imported & above)}"
    assert all(n.startswith("ringflash.transport.") for n in imported), f"{path.name}: {sorted(imported)}"
    if path.name == "groups.py":
        assert not imported, "groups.py is plain torch.distributed"


def test_every_transport_implements_the_interface():
    assert TRANSPORTS == ("nccl", "copy-engine")
    comms = [RingComm(), CopyEngineComm(), NullComm(0, 2)]  # no process group: one rank
    assert [c.name for c in comms] == ["nccl", "copy-engine", "null"]
    assert all(isinstance(c, Transport) for c in comms)


# ---- choosing a transport ----------------------------------------------------------------------


def test_resolve_transport(monkeypatch):
    monkeypatch.delenv("RINGFLASH_TRANSPORT", raising=False)
    assert resolve_transport(None) == "nccl"
    monkeypatch.setenv("RINGFLASH_TRANSPORT", "copy-engine")
    assert resolve_transport(None) == "copy-engine"
    assert resolve_transport("nccl") == "nccl", "the argument wins over the variable"


def test_resolve_transport_errors_name_the_argument_or_the_variable(monkeypatch):
    monkeypatch.setenv("RINGFLASH_TRANSPORT", "nvlink")
    with pytest.raises(ValueError, match=r"RINGFLASH_TRANSPORT must be one of \('nccl', 'copy-engine'\), got 'nvlink'"):
        resolve_transport(None)
    with pytest.raises(ValueError, match=r"transport must be one of \('nccl', 'copy-engine'\) or None, got 'gloo'"):
        resolve_transport("gloo")


def test_factory_takes_a_resolved_name_only(monkeypatch):
    # Below the entry points the environment is not read: None is not a name.
    monkeypatch.setenv("RINGFLASH_TRANSPORT", "copy-engine")
    assert ring_comm().name == "nccl"
    for bad in (None, "nvlink"):
        with pytest.raises(ValueError, match=rf"transport must be one of \('nccl', 'copy-engine'\), got {bad!r}"):
            ring_comm(None, bad)


def _ring_comm_worker(rank, world):
    # One comm per group and transport (the ring asks three times a call); what the constructor
    # rejects is rejected every time, never cached.
    group = dist.new_group([1, 2])
    with pytest.raises(TypeError, match=r"group must be a torch\.distributed\.ProcessGroup"):
        ring_comm("ranks 1 and 2")
    # A list of ranks (not hashable) gets the constructor's error, not the cache's.
    with pytest.raises(TypeError, match=r"group must be a torch\.distributed\.ProcessGroup or None, got list"):
        ring_comm([0, 1, 2])
    for _ in range(2):
        with pytest.raises(ValueError, match=r"transport: copy-engine needs an NCCL group.*gloo"):
            ring_comm(None, "copy-engine")
    if rank == 0:
        for _ in range(2):
            with pytest.raises(ValueError, match="not a member"):
                ring_comm(group)
    else:
        assert ring_comm(group) is ring_comm(group, "nccl") and ring_comm(group) is not ring_comm(None)
        assert (ring_comm(group).rank, ring_comm(group).world) == (rank - 1, 2)
    default = ring_comm()
    assert default is ring_comm(None, "nccl") and (default.rank, default.world) == (rank, world)
    assert type(default) is RingComm
    dist.barrier()  # rank 0 hosts the store: it must not leave while the others still use it
    return True


def test_ring_comm_is_made_once_per_group_and_transport():
    assert run_ranks(_ring_comm_worker, 3) == [True] * 3


# ---- the ring over a gloo group ----------------------------------------------------------------


def _hop_worker(rank, world):
    comm = ring_comm()
    send = torch.full((2, 3), float(rank))
    recv = comm.buffer("kv0", send.shape, send.dtype, send.device)
    comm.send_recv(send, recv).wait()
    return recv.unique().tolist()


def test_gloo_ring_moves_each_block_to_the_next_rank():
    assert run_ranks(_hop_worker, 3) == [[2.0], [0.0], [1.0]]


def _comm_contract_worker(rank, world):
    comm = ring_comm()
    x = torch.arange(6.0).reshape(2, 3) + 100 * rank
    # Buffers gloo would misread (or wait on forever) are refused before anything is posted.
    for send, recv, match in (
        (x.t(), torch.empty(3, 2), "must be contiguous"),
        (x, torch.empty(3, 2), "must match"),
        (x, torch.empty(2, 3, dtype=torch.float64), "must match"),
    ):
        with pytest.raises(ValueError, match=match):
            comm.send_recv(send, recv)
    # Two transfers in flight, posted in opposite orders by neighbouring ranks: the tags pair each
    # receive with its own send (same sizes, so a mix-up would pass unnoticed by gloo).
    ra, rb = torch.empty_like(x), torch.empty_like(x)
    posts = [(x, ra, 0), (-x, rb, 1)]
    for transfer in [comm.send_recv(*p) for p in (posts if rank % 2 == 0 else posts[::-1])]:
        transfer.wait()
    prev = torch.arange(6.0).reshape(2, 3) + 100 * ((rank - 1) % world)
    assert torch.equal(ra, prev) and torch.equal(rb, -prev), "received from the previous rank, by tag"
    # An NCCL group's small collective runs on its gloo twin (an NCCL one would wait for the GPU).
    nccl_like = RingComm()
    nccl_like._names = {"nccl"}  # as an NCCL group reports itself (this one is gloo, so it can run here)
    used, all_gather = [], dist.all_gather
    dist.all_gather = lambda out, t, group=None: used.append(group) or all_gather(out, t, group=group)
    try:
        rows = nccl_like.all_gather_ints([rank, -rank])
    finally:
        dist.all_gather = all_gather
    assert rows == [[r, -r] for r in range(world)] and used == [host_group(None)]
    dist.barrier()
    return True


def test_ring_comm_contract():
    assert run_ranks(_comm_contract_worker, 3) == [True] * 3


def _host_group_worker(rank, world):
    # An NCCL-only group's check runs over a gloo twin made by the group's own ranks only: here
    # ranks {0, 1} and {2, 3} each make theirs without the other pair taking part.
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine = pairs[rank // 2]
    comm = RingComm(mine)
    comm._names = {"nccl"}  # as an NCCL group reports itself (this one is gloo, so it can run here)
    rows = comm.all_gather_ints([rank, 10 * rank])
    twin = host_group(mine)
    assert twin is host_group(mine) and twin is not mine, "made once, and a group of its own"
    assert dist.get_backend(twin) == "gloo" and dist.get_process_group_ranks(twin) == dist.get_process_group_ranks(mine)
    return rows


def test_cross_rank_check_of_nccl_group_runs_on_a_gloo_twin():
    pair0, pair1 = [[0, 0], [1, 10]], [[2, 20], [3, 30]]
    assert run_ranks(_host_group_worker, 4) == [pair0, pair0, pair1, pair1]


def test_one_rank_has_nobody_to_send_to():
    alone = RingComm()
    assert (alone.rank, alone.world) == (0, 1) and alone.all_gather_ints([3, 4]) == [[3, 4]]
    with pytest.raises(RuntimeError, match="a ring of one rank has nobody to send to"):
        alone.send_recv(torch.zeros(2), torch.zeros(2))


def test_nccl_options_ask_for_high_priority_streams():
    if not dist.is_nccl_available():
        with pytest.raises(RuntimeError, match="nccl_options: this build of torch has no NCCL"):
            ringflash.nccl_options()
    else:
        assert ringflash.nccl_options().is_high_priority_stream


# ---- NullComm ----------------------------------------------------------------------------------


def test_null_comm_moves_nothing_and_keeps_its_buffers():
    # The compute-only ring times kernels alone: no copy stands in for a transfer, and the
    # receive buffers (random, finite) are made once, again only when the shape changes.
    null = NullComm(0, 2)
    buf = null.buffer("kv0", (2, 3), torch.bfloat16, torch.device("cpu"))
    before = buf.clone()
    null.send_recv(torch.ones(2, 3, dtype=torch.bfloat16), buf).wait()
    assert torch.equal(buf, before) and torch.isfinite(buf).all() and buf.abs().sum() > 0
    assert null.buffer("kv0", (2, 3), torch.bfloat16, torch.device("cpu")) is buf
    assert null.buffer("kv0", (4, 3), torch.bfloat16, torch.device("cpu")).shape == (4, 3)
    assert null.keep(buf) is buf and null.all_gather_ints([1, 2]) == [[1, 2], [1, 2]]


@pytest.mark.parametrize("rank, world", [(-1, 2), (2, 2), (0, 0)])
def test_null_comm_rank_must_be_in_the_world(rank, world):
    with pytest.raises(ValueError, match=rf"rank must be in \[0, world={world}\), got {rank}"):
        NullComm(rank, world)
