"""Ring transfers between the GPUs of one host by copy engine, through torch symmetric memory.

`CopyEngineComm` is the transport named "copy-engine": for an NCCL group whose ranks share a
host. NCCL's send/recv run as kernels on SMs, beside the attention kernels they should hide
behind, and slow them; a copy engine moves the bytes over NVLink without taking an SM. The
bytes moved are the same, so results are bit-identical to NCCL's.

How a block travels (push): the sender writes it straight into the next rank's receive buffer,
one `cudaMemcpyAsync` on a side stream, ordered by two stream-ordered signals of the group's
symmetric memory:
- "free": the receiver puts it when its own stream reaches the transfer's posting, i.e. after
  everything queued before that read the receive buffer; the sender's copy waits for it;
- "written": the sender puts it after the copy; the receiver's stream waits for it in `wait()`.
Every signal is consumed within its transfer, so nothing carries over between calls. A peer
that never signals makes the waiting kernel trap after the group's timeout (the process then
fails with a CUDA error) rather than spin forever.

Receive buffers must be symmetric (the same offset in every rank's mapping): they are slices of
one heap per group, laid out by `reserve` at the start of each ring call (and grown there,
collectively, only when a call needs more), handed out by `buffer(name, ...)`. The next call
reuses them, so what outlives a call is copied out (`keep`).
"""

from __future__ import annotations

import datetime
import math
import warnings

import torch
import torch.distributed as dist

from ringflash.transport.groups import group_key, group_timeout, host_group
from ringflash.transport.p2p import RingComm

__all__ = ["CopyEngineComm"]


class _CopyTransfer:
    __slots__ = ("_copied", "_handle", "_prev", "_send", "_tag", "_timeout_ms")

    def __init__(self, handle, prev: int, tag: int, copied: torch.cuda.Event, send: torch.Tensor, timeout_ms: int):
        self._handle, self._prev, self._tag, self._copied = handle, prev, tag, copied
        self._timeout_ms = timeout_ms
        self._send = send  # alive until copied: the caller may drop it (e.g. a temporary cast) at once

    def wait(self) -> None:
        # The previous rank's block is in our receive buffer, and ours has left our send buffer.
        self._handle.wait_signal(self._prev, channel=2 * self._tag + 1, timeout_ms=self._timeout_ms)
        torch.cuda.current_stream().wait_event(self._copied)
        self._send = None


class _SymmetricRing:
    """The copy-engine ring's heap, streams and signals over `group` (NCCL, one host), made once
    per group (`_for_group`) however many `CopyEngineComm`s share it."""

    # The receive buffers of a ring call, in their order in the heap: K/V (two when W > 2, three
    # when W > 3: the forward keeps its first block for the backward) and the dK/dV accumulators
    # (float32; at W = 2 cuDNN's bf16 ones use half).
    _LAYOUT = ("kv0", "kv1", "kv2", "dkv")

    def __init__(self, group: dist.ProcessGroup, device: torch.device):
        from torch.distributed import _symmetric_memory as symm_mem

        self._symm_mem = symm_mem
        self.group, self.device = group, device
        with warnings.catch_warnings():  # deprecated (a no-op need) in newer torch; the working experiment called it
            warnings.simplefilter("ignore", FutureWarning)
            symm_mem.enable_symm_mem_for_group(group.group_name)
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.next, self.prev = (self.rank + 1) % self.world, (self.rank - 1) % self.world
        timeout = group_timeout(group) or datetime.timedelta(minutes=10)  # 10 min: torch's NCCL default
        self.timeout_ms = int(timeout.total_seconds() * 1000)  # a signal not put by then traps the waiting kernel
        self._streams: dict[int, torch.cuda.Stream] = {}  # one per tag: K/V and dK/dV travel together
        self._heap: torch.Tensor | None = None  # uint8, symmetric
        self._handle = None
        self._offsets: dict[str, int] = {}

    def reserve(self, kv: torch.Tensor) -> None:
        """Lay out the heap for a ring call over packed K/V blocks like `kv`, growing it if needed.

        Called at the start of every ring call, before anything of it is posted. Growing is the
        transport's one collective step (synchronise the device, meet at a host barrier, allocate,
        rendezvous): done there, every rank's GPU is idle, so no kernel spins on a signal whose
        sender waits in the same collective (as buffers made lazily, between transfers, would).
        """
        kv_bytes = kv.numel() * kv.element_size()
        sizes = {"kv0": kv_bytes, "kv1": kv_bytes if self.world > 2 else 0, "kv2": kv_bytes if self.world > 3 else 0,
                 "dkv": 2 * kv.numel() * 4}
        total = 0
        for name in self._LAYOUT:
            self._offsets[name] = total
            total += -(-sizes[name] // 512) * 512
        if self._heap is None or self._heap.numel() < total:
            torch.cuda.synchronize(self.device)
            dist.barrier(group=host_group(self.group))
            self._heap = self._handle = None  # every rank is idle: the old heap can go
            heap = self._symm_mem.empty(total, dtype=torch.uint8, device=self.device)
            self._handle = self._symm_mem.rendezvous(heap, self.group)
            self._heap = heap

    def buffer(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The receive buffer `name` of the call `reserve` laid out, viewed as `shape`/`dtype`."""
        if self._heap is None:
            raise RuntimeError("copy-engine buffer before reserve(): the ring reserves at the start of each call")
        start = self._offsets[name]
        return self._heap[start : start + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)

    def owns(self, t: torch.Tensor) -> bool:
        return self._heap is not None and 0 <= t.data_ptr() - self._heap.data_ptr() < self._heap.numel()

    def send_recv(self, send: torch.Tensor, recv: torch.Tensor, tag: int) -> _CopyTransfer:
        """Post: `send` into the next rank's buffer at `recv`'s place in ours; `recv` from the previous rank."""
        if not self.owns(recv):
            raise ValueError("recv: a copy-engine transfer receives into a buffer from CopyEngineComm.buffer()")
        handle, offset = self._handle, recv.data_ptr() - self._heap.data_ptr()
        current = torch.cuda.current_stream(self.device)
        handle.put_signal(self.prev, channel=2 * tag, timeout_ms=self.timeout_ms)  # our `recv` is free
        side = self._streams.get(tag)
        if side is None:  # made once: making a Stream is host time the GPU would wait for, every call
            side = self._streams[tag] = torch.cuda.Stream(self.device, priority=-1)
        side.wait_stream(current)  # `send` is ready
        with torch.cuda.stream(side):
            handle.wait_signal(self.next, channel=2 * tag, timeout_ms=self.timeout_ms)  # theirs is free
            dst = handle.get_buffer(self.next, tuple(recv.shape), recv.dtype, offset // recv.element_size())
            dst.copy_(send)
            handle.put_signal(self.next, channel=2 * tag + 1, timeout_ms=self.timeout_ms)
            copied = torch.cuda.Event()
            copied.record(side)
        return _CopyTransfer(handle, self.prev, tag, copied, send, self.timeout_ms)


_rings: dict[tuple, _SymmetricRing] = {}


def _for_group(group: dist.ProcessGroup | None, device: torch.device) -> _SymmetricRing:
    """The group's heap and signals, made on first use (once per rank set, like `host_group`'s twins)."""
    group, key = group_key(group)
    if key not in _rings:
        _rings[key] = _SymmetricRing(group, device)
    return _rings[key]


class CopyEngineComm(RingComm):
    """The ring over `group` (NCCL, ranks of one host) whose CUDA blocks travel by copy engine: a
    `Transport` named "copy-engine". CPU tensors and the small collective go as in `RingComm`.

    Raises ValueError naming the transport if the group has no NCCL backend.
    """

    name = "copy-engine"

    def __init__(self, group: dist.ProcessGroup | None = None):
        super().__init__(group)
        self._ring = None
        if self.world > 1:
            if "nccl" not in self._names:
                raise ValueError(
                    "transport: copy-engine needs an NCCL group (GPUs of one host); this group's "
                    f"backend is {dist.get_backend(group)}"
                )
            self._ring = _for_group(group, torch.device("cuda", torch.cuda.current_device()))

    def buffer(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """For CUDA, the persistent symmetric buffer `name`, which the next call reuses (see `keep`)."""
        if self._ring is not None and device.type == "cuda":
            return self._ring.buffer(name, tuple(shape), dtype)
        return super().buffer(name, shape, dtype, device)

    def keep(self, t: torch.Tensor) -> torch.Tensor:
        return t.clone() if self._ring is not None and self._ring.owns(t) else t

    def reserve(self, kv: torch.Tensor) -> None:
        if self._ring is not None and kv.is_cuda:
            self._ring.reserve(kv)

    def send_recv(self, send: torch.Tensor, recv: torch.Tensor, tag: int = 0):
        if self._ring is None or not send.is_cuda:
            return super().send_recv(send, recv, tag)
        self._check_pair(send, recv)
        return self._ring.send_recv(send, recv, tag)
