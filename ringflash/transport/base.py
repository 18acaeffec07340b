"""The one interface every transport implements: what the ring loop (ringflash/ring.py) is handed.

A transport is a small object bound to one process group. The ring loop calls only the methods
below and never asks which transport it holds, so a new way of moving bytes is a new class here,
not a branch in the loop.

The all-to-all: head parallelism (Ulysses, ringflash/hybrid.py) swaps "my tokens, all heads"
for "the ring shard's tokens, my heads" and back around the ring. It is one more method of the
same object, `all_to_all(send, recv, tag) -> Transfer` (each rank's `send` cut into `world`
equal chunks along its first dim, chunk j to rank j; `recv` gathers chunk `rank` of every rank,
in rank order): the group's own `all_to_all_single` (RingComm, and CopyEngineComm by
inheritance), nothing for `NullComm`. The ring never calls it; the hybrid hands it the head
group's transport.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist

__all__ = ["Transfer", "Transport"]


class Transfer(Protocol):
    """A posted transfer; `wait()` completes it for the current stream (no host sync required)."""

    def wait(self) -> None: ...


@runtime_checkable
class Transport(Protocol):
    """The ring's communicator over `group`: rank `rank` of `world`, moving blocks the way `name` says.

    `name` is the transport's entry in `ringflash.transport.TRANSPORTS` (what the cross-rank
    check compares), `"null"` for the stand-in with no communication.
    """

    rank: int
    world: int
    group: dist.ProcessGroup | None
    name: str

    def send_recv(self, send: torch.Tensor, recv: torch.Tensor, tag: int = 0) -> Transfer:
        """Post `send` to rank `rank + 1` and the previous rank's block into `recv`; return at once.

        Buffers contiguous and alike; neither written until `wait()`, `recv` not read either.
        Transfers in flight together take different `tag`s.
        """
        ...

    def buffer(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A buffer to receive into, by name: new memory, or one the transport keeps between calls."""
        ...

    def keep(self, t: torch.Tensor) -> torch.Tensor:
        """`t`, safe to outlive the ring call: a copy if it lives in a buffer the next call reuses."""
        ...

    def reserve(self, kv: torch.Tensor) -> None:
        """Room for a ring call over packed K/V blocks like `kv` (`ring.pack_kv`), made before anything is posted."""
        ...

    def all_to_all(self, send: torch.Tensor, recv: torch.Tensor, tag: int = 0) -> Transfer:
        """Post: `send`'s chunk j (of `world` equal chunks along dim 0) to rank j, and every rank's
        chunk `rank` into `recv`, in rank order. Buffers contiguous and alike."""
        ...

    def all_gather_ints(self, values: list[int]) -> list[list[int]]:
        """Every rank's `values` (same length everywhere), in rank order, without waiting for the GPU."""
        ...
