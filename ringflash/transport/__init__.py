"""How the ring's blocks travel between ranks: one small interface, one class per way.

    comm = ring_comm(group, "nccl")        # made once per group and transport
    comm.reserve(kv); recv = comm.buffer("kv0", kv.shape, kv.dtype, kv.device)
    comm.send_recv(kv, recv, tag=0).wait()

- `base.Transport`: the interface the ring loop is handed (and where an all-to-all would join).
- `p2p.RingComm` ("nccl"): the group's own send/recv; NCCL, or gloo with CUDA tensors staged
  through pinned host memory.
- `copy_engine.CopyEngineComm` ("copy-engine"): CUDA blocks pushed by the GPUs' copy engines
  into the next rank's symmetric buffer (ranks of one host), no SM taken from attention.
- `null.NullComm`: no communication, for timing compute alone.
- `groups`: process-group helpers (`nccl_options`, gloo twins for host-side collectives).

The transport's name is resolved once, where it enters (`ring_flash_attn_func(transport=)`,
the training config's `parallel.transport`): `resolve_transport` reads `RINGFLASH_TRANSPORT`
only when given None, and everything below takes the resolved name as a value.
"""

from __future__ import annotations

import os

import torch.distributed as dist

from ringflash.transport.base import Transfer, Transport
from ringflash.transport.copy_engine import CopyEngineComm
from ringflash.transport.groups import group_key, host_group, nccl_options
from ringflash.transport.null import NullComm
from ringflash.transport.p2p import RingComm

__all__ = [
    "TRANSPORTS",
    "CopyEngineComm",
    "NullComm",
    "RingComm",
    "Transfer",
    "Transport",
    "group_key",
    "host_group",
    "nccl_options",
    "resolve_transport",
    "ring_comm",
]

_CLASSES = {cls.name: cls for cls in (RingComm, CopyEngineComm)}
TRANSPORTS = tuple(_CLASSES)  # ("nccl", "copy-engine"): how a group's blocks travel


def resolve_transport(transport: str | None) -> str:
    """`transport`, or with None the environment's `RINGFLASH_TRANSPORT` (default `nccl`), checked.

    For entry points only: what they resolve, they pass down as a value.
    """
    if transport is None:
        env = os.environ.get("RINGFLASH_TRANSPORT", "nccl")
        if env not in TRANSPORTS:
            raise ValueError(f"RINGFLASH_TRANSPORT must be one of {TRANSPORTS}, got {env!r}")
        return env
    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {TRANSPORTS} or None, got {transport!r}")
    return transport


_comms: dict[tuple, Transport] = {}


def ring_comm(group: dist.ProcessGroup | None = None, transport: str = "nccl") -> Transport:
    """The transport named `transport` (one of `TRANSPORTS`) over `group`, made once per group and
    transport under the current default group.

    The ring asks for it three times a call (the API, the forward and the backward op), and each
    new one reads the group's ranks and backend again: host time the GPU ends up waiting for.
    What the constructor rejects (a `group` that is not a process group of this rank, copy
    engines on a gloo group) raises every time and is never cached.
    """
    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
    cls = _CLASSES[transport]
    if group is not None and not isinstance(group, dist.ProcessGroup):
        return cls(group)  # raises, naming `group` (and an unhashable one must not reach the cache)
    world = dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
    key = (world, group, transport)
    if key not in _comms:
        _comms[key] = cls(group)
    return _comms[key]
