"""The ring over the process group's own send/recv: NCCL, or gloo (with host staging for CUDA).

`RingComm.send_recv(send, recv)` posts both transfers with `dist.batch_isend_irecv` and returns
at once; `.wait()` on the result completes them. The ring loop posts step s+1's transfer before
computing step s (double buffering), so the next block travels while this one is computed.

How a buffer travels follows the group's backend and the buffer's device, and nothing outside
this file branches on it:
- NCCL, CUDA buffers: directly. The transfer runs on NCCL's stream, ordered after the work
  already queued on the current stream; `wait()` only makes the current stream wait for it, so
  the host never blocks (no host synchronisation inside the ring loop). Give the group
  high-priority streams (`nccl_options()`) or the transfers queue behind attention's SMs.
- gloo, CPU buffers: directly (gloo works on its own threads).
- gloo, CUDA buffers: staged through pinned host memory. This is how 2–4 ranks share one GPU
  (NCCL refuses two ranks on one device). gloo reads host memory from its own thread as soon as
  the send is posted, so the device-to-host copy must have finished first: one stream
  synchronisation per transfer, at posting time, i.e. after the previous step's compute. The
  copy back to the device is queued on the current stream in `wait()`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ringflash.transport.groups import backend_names, host_group

__all__ = ["RingComm"]


class _Transfer:
    """An in-flight send/recv pair; `wait()` completes it (and unstages a staged receive)."""

    __slots__ = ("_host_recv", "_recv", "_send", "_works")

    def __init__(self, works, recv=None, send=None, host_recv=None):
        self._works = works
        self._recv = recv
        # What is being sent stays alive until it has been sent: the caller may drop its own
        # reference (e.g. to a temporary cast) right after posting.
        self._send = send
        self._host_recv = host_recv

    def wait(self) -> None:
        for w in self._works:
            w.wait()
        if self._host_recv is not None:
            # Pinned source: an async copy queued on the current stream, before the compute that
            # reads `recv`. The caching host allocator keeps the block until the copy is done.
            self._recv.copy_(self._host_recv, non_blocking=True)
        self._works, self._send, self._host_recv = [], None, None


class RingComm:
    """The ring over `group`'s own send/recv (None: the default group, or a single process if none
    is set up): a `Transport` named "nccl", whatever the group's backend (NCCL or gloo).

    Attributes: `rank` and `world` within the group; `group`; `name`. Raises TypeError/ValueError
    naming `group` if it is not a process group this rank belongs to. Make it through
    `ringflash.transport.ring_comm`, which keeps one per group.
    """

    name = "nccl"

    def __init__(self, group: dist.ProcessGroup | None = None):
        self.group = group
        if group is None and not (dist.is_available() and dist.is_initialized()):
            self.rank, self.world, self._names = 0, 1, set()
            return
        if group is dist.GroupMember.NON_GROUP_MEMBER:
            raise ValueError(
                "group: this rank is not a member of the process group it was given "
                "(dist.new_group returns a placeholder on ranks outside the group)"
            )
        if group is not None and not isinstance(group, dist.ProcessGroup):
            raise TypeError(f"group must be a torch.distributed.ProcessGroup or None, got {type(group).__name__}")
        if not dist.is_initialized():
            raise ValueError("group was given but torch.distributed is not initialised")
        self.rank = dist.get_rank(group)
        if self.rank < 0:
            raise ValueError(f"group: this rank (global rank {dist.get_rank()}) is not a member of it")
        self.world = dist.get_world_size(group)
        self._names = backend_names(group)
        to_global = (lambda r: r) if group is None else (lambda r: dist.get_global_rank(group, r))
        self.next_peer = to_global((self.rank + 1) % self.world)
        self.prev_peer = to_global((self.rank - 1) % self.world)

    def buffer(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """New memory to receive into (`name` matters only to transports that keep buffers)."""
        return torch.empty(shape, dtype=dtype, device=device)

    def keep(self, t: torch.Tensor) -> torch.Tensor:
        """`t` itself: no buffer here outlives its call."""
        return t

    def reserve(self, kv: torch.Tensor) -> None:
        """Nothing to reserve: buffers are allocated as they are asked for."""

    def _staged(self, device: torch.device) -> bool:
        if device.type == "cuda":
            return "gloo" in self._names and "nccl" not in self._names
        if self._names == {"nccl"}:
            raise ValueError(
                f"{device.type} tensors need a gloo group; this group's backend is NCCL only "
                "(use CUDA tensors, or a group created with backend='gloo')"
            )
        return False

    def _check_pair(self, send: torch.Tensor, recv: torch.Tensor, what: str = "send and recv") -> None:
        if not (send.is_contiguous() and recv.is_contiguous()):
            raise ValueError(f"{what} buffers must be contiguous")
        if send.shape != recv.shape or send.dtype != recv.dtype or send.device != recv.device:
            raise ValueError(
                f"{what} buffers must match: {send.shape}/{send.dtype}/{send.device} vs "
                f"{recv.shape}/{recv.dtype}/{recv.device}"
            )

    def _stage(self, send: torch.Tensor, recv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """`(src, dst, host_recv)`: the buffers the collective moves. CUDA buffers on a gloo-only
        group go through pinned host memory; gloo reads the host copy from its own thread as soon
        as the operation is posted, so the device-to-host copy must have finished first."""
        if not self._staged(send.device):
            return send, recv, None
        host_send = torch.empty(send.shape, dtype=send.dtype, pin_memory=True)
        host_recv = torch.empty(recv.shape, dtype=recv.dtype, pin_memory=True)
        host_send.copy_(send, non_blocking=True)
        torch.cuda.current_stream(send.device).synchronize()
        return host_send, host_recv, host_recv

    def send_recv(self, send: torch.Tensor, recv: torch.Tensor, tag: int = 0) -> _Transfer:
        """Post: `send` to the next rank, the previous rank's buffer into `recv`. Returns at once.

        Both buffers must be contiguous and alike; neither may be written until `wait()`, and
        `recv` not read either. Concurrent transfers (K/V and dK/dV in the backward) take
        different `tag`s so gloo can never pair one's send with the other's receive.
        """
        if self.world == 1:
            raise RuntimeError("a ring of one rank has nobody to send to (a rank cannot send to itself)")
        self._check_pair(send, recv)
        src, dst, host_recv = self._stage(send, recv)
        ops = [
            dist.P2POp(dist.isend, src, self.next_peer, self.group, tag),
            dist.P2POp(dist.irecv, dst, self.prev_peer, self.group, tag),
        ]
        works = dist.batch_isend_irecv(ops)
        return _Transfer(works, recv, src, host_recv)

    def all_to_all(self, send: torch.Tensor, recv: torch.Tensor, tag: int = 0) -> _Transfer:
        """Post an all-to-all over the group and return at once: `send`'s `world` equal chunks along
        dim 0 go to ranks 0 … world−1, and `recv`'s chunk j is rank j's chunk `rank`.

        The group's own `all_to_all_single` (NCCL, or gloo, which has it for CPU tensors); CUDA
        buffers on a gloo-only group are staged through pinned host memory as in `send_recv`.
        `tag` is accepted for the interface: a collective is matched by its order, not a tag.
        """
        self._check_pair(send, recv, "all_to_all")
        if send.shape[0] % self.world:
            raise ValueError(f"all_to_all: dim 0 of size {send.shape[0]} does not split over {self.world} ranks")
        if self.world == 1:
            recv.copy_(send)
            return _Transfer([])
        src, dst, host_recv = self._stage(send, recv)
        work = dist.all_to_all_single(dst, src, group=self.group, async_op=True)
        return _Transfer([work], recv, src, host_recv)

    def all_gather_ints(self, values: list[int]) -> list[list[int]]:
        """Every rank's `values` (same length everywhere), in rank order: one small collective.

        It runs on CPU, so it does not wait for queued GPU work: over the group itself if it has
        gloo, else over its gloo twin (`host_group`). Only a torch built without gloo runs it on
        the current CUDA device, and reading the result back is then a host synchronisation.
        """
        if self.world == 1:
            return [list(values)]
        group, device = self.group, torch.device("cpu")
        if "gloo" not in self._names:
            if dist.is_gloo_available():
                group = host_group(self.group)
            else:
                device = torch.device("cuda", torch.cuda.current_device())
        t = torch.tensor(values, dtype=torch.int64, device=device)
        out = [torch.empty_like(t) for _ in range(self.world)]
        dist.all_gather(out, t, group=group)
        return torch.stack(out).tolist()
