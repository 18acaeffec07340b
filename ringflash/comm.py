"""Ring communication over a process group: send to the next rank, receive from the previous.

`RingComm.send_recv(send, recv)` posts both transfers with `dist.batch_isend_irecv` and returns
at once; `.wait()` on the result completes them. The ring loop posts step s+1's transfer before
computing step s (double buffering), so the next block travels while this one is computed.

How a buffer travels follows the group's backend and the buffer's device, and nothing outside
this file branches on it:
- NCCL, CUDA buffers: directly. The transfer runs on NCCL's stream, ordered after the work
  already queued on the current stream; `wait()` only makes the current stream wait for it, so
  the host never blocks (no host synchronisation inside the ring loop).
- NCCL, CUDA buffers, `transport="copy-engine"`: pushed into the next rank's receive buffer by
  the GPUs' copy engines, no SM taken (ringflash/peer.py: ranks of one host).
- gloo, CPU buffers: directly (gloo works on its own threads).
- gloo, CUDA buffers: staged through pinned host memory. This is how 2–4 ranks share one GPU
  (NCCL refuses two ranks on one device). gloo reads host memory from its own thread as soon as
  the send is posted, so the device-to-host copy must have finished first: one stream
  synchronisation per transfer, at posting time, i.e. after the previous step's compute. The
  copy back to the device is queued on the current stream in `wait()`.

Give the ring's NCCL group high-priority streams (`nccl_options()`): a transfer is posted before
the compute it should hide behind, but its kernel becomes runnable only when the work queued
before it ends, together with the next attention kernel; on a default-priority stream the GPU
hands every SM to that kernel's thousands of blocks first and the transfer runs at its tail,
exposed.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

__all__ = ["TRANSPORTS", "NullComm", "RingComm", "host_group", "nccl_options", "resolve_transport", "ring_comm"]

TRANSPORTS = ("nccl", "copy-engine")  # how an NCCL group's blocks travel (RingComm)


def resolve_transport(transport: str | None) -> str:
    """`transport`, or with None the environment's `RINGFLASH_TRANSPORT` (default `nccl`), checked."""
    if transport is None:
        env = os.environ.get("RINGFLASH_TRANSPORT", "nccl")
        if env not in TRANSPORTS:
            raise ValueError(f"RINGFLASH_TRANSPORT must be one of {TRANSPORTS}, got {env!r}")
        return env
    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {TRANSPORTS} or None, got {transport!r}")
    return transport


def nccl_options() -> dist.ProcessGroupNCCL.Options:
    """Options for the NCCL group the ring runs on: high-priority streams.

        dist.init_process_group("nccl", pg_options=ringflash.nccl_options())
        # or, for a ("dp", "cp") mesh:
        init_device_mesh("cuda", (dp, cp), mesh_dim_names=("dp", "cp"), backend_override={"cp": nccl_options()})

    (`TORCH_NCCL_HIGH_PRIORITY=1` does the same for every group.) On 2×H200 at 32k tokens per rank
    this takes the ring's forward+backward from 81.7 to 79.9 ms, at 8k from 6.3 to 5.8 ms: the
    hops it posts early then travel during the compute instead of after it (docs/PERF_NOTES.md).
    """
    if not dist.is_nccl_available():
        raise RuntimeError("nccl_options: this build of torch has no NCCL (use a gloo group on CPU)")
    return dist.ProcessGroupNCCL.Options(is_high_priority_stream=True)


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


def _backend_names(group) -> set[str]:
    # "gloo", "nccl" or a per-device spec such as "cpu:gloo,cuda:nccl".
    spec = str(dist.get_backend(group))
    return {part.split(":")[-1].strip().lower() for part in spec.split(",")}


class RingComm:
    """The ring over `group` (None: the default group, or a single process if none is set up).

    Attributes: `rank` and `world` within the group; `group`. Raises TypeError/ValueError naming
    `group` if it is not a process group this rank belongs to.

    `transport="copy-engine"` moves an NCCL group's blocks by copy engine instead (ringflash/
    peer.py; the ranks must share a host); `"nccl"` through NCCL; None: `resolve_transport`.
    """

    def __init__(self, group: dist.ProcessGroup | None = None, transport: str | None = None):
        self.group = group
        self._peer = None
        self.transport = transport = resolve_transport(transport)
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
        self._names = _backend_names(group)
        to_global = (lambda r: r) if group is None else (lambda r: dist.get_global_rank(group, r))
        self.next_peer = to_global((self.rank + 1) % self.world)
        self.prev_peer = to_global((self.rank - 1) % self.world)
        if transport == "copy-engine" and self.world > 1:
            if "nccl" not in self._names:
                raise ValueError(
                    "transport: copy-engine needs an NCCL group (GPUs of one host); this group's "
                    f"backend is {dist.get_backend(group)}"
                )
            from ringflash import peer

            self._peer = peer.for_group(group, torch.device("cuda", torch.cuda.current_device()))

    def buffer(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A buffer for the ring to receive into: new memory, or with the copy-engine transport
        the persistent symmetric buffer `name`, which the next call reuses (see `keep`)."""
        if self._peer is not None and device.type == "cuda":
            return self._peer.buffer(name, tuple(shape), dtype)
        return torch.empty(shape, dtype=dtype, device=device)

    def keep(self, t: torch.Tensor) -> torch.Tensor:
        """`t`, safe to outlive the call: a copy if it lives in a buffer the next call reuses."""
        return t.clone() if self._peer is not None and self._peer.owns(t) else t

    def reserve(self, kv: torch.Tensor) -> None:
        """Room for a ring call's receive buffers, made before it posts anything (copy engine only)."""
        if self._peer is not None and kv.is_cuda:
            self._peer.reserve(kv)

    def _staged(self, device: torch.device) -> bool:
        if device.type == "cuda":
            return "gloo" in self._names and "nccl" not in self._names
        if self._names == {"nccl"}:
            raise ValueError(
                f"{device.type} tensors need a gloo group; this group's backend is NCCL only "
                "(use CUDA tensors, or a group created with backend='gloo')"
            )
        return False

    def send_recv(self, send: torch.Tensor, recv: torch.Tensor, tag: int = 0) -> _Transfer:
        """Post: `send` to the next rank, the previous rank's buffer into `recv`. Returns at once.

        Both buffers must be contiguous and alike; neither may be written until `wait()`, and
        `recv` not read either. Concurrent transfers (K/V and dK/dV in the backward) take
        different `tag`s so gloo can never pair one's send with the other's receive.
        """
        if self.world == 1:
            raise RuntimeError("a ring of one rank has nobody to send to (a rank cannot send to itself)")
        if not (send.is_contiguous() and recv.is_contiguous()):
            raise ValueError("send and recv buffers must be contiguous")
        if send.shape != recv.shape or send.dtype != recv.dtype or send.device != recv.device:
            raise ValueError(
                f"send and recv buffers must match: {send.shape}/{send.dtype}/{send.device} vs "
                f"{recv.shape}/{recv.dtype}/{recv.device}"
            )
        if self._peer is not None and send.is_cuda:
            return self._peer.send_recv(send, recv, tag)
        host_send = host_recv = None
        src, dst = send, recv
        if self._staged(send.device):
            host_send = torch.empty(send.shape, dtype=send.dtype, pin_memory=True)
            host_recv = torch.empty(recv.shape, dtype=recv.dtype, pin_memory=True)
            host_send.copy_(send, non_blocking=True)
            torch.cuda.current_stream(send.device).synchronize()  # gloo reads host_send right away
            src, dst = host_send, host_recv
        ops = [
            dist.P2POp(dist.isend, src, self.next_peer, self.group, tag),
            dist.P2POp(dist.irecv, dst, self.prev_peer, self.group, tag),
        ]
        works = dist.batch_isend_irecv(ops)
        return _Transfer(works, recv, src, host_recv)

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


_comms: dict[tuple, RingComm] = {}


def ring_comm(group: dist.ProcessGroup | None = None, transport: str | None = None) -> RingComm:
    """`RingComm(group, transport)`, made once per group and transport under the current default
    group. The ring asks for it three times a call (the API, the forward and the backward op), and
    each new one reads the group's ranks and backend again: host time that, at 8k tokens per
    rank, the GPU ends up waiting for. Arguments that are not a process group raise as
    `RingComm` does.
    """
    transport = resolve_transport(transport)
    if group is not None and not isinstance(group, dist.ProcessGroup):
        return RingComm(group, transport)
    world = dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
    key = (world, group, transport)
    if key not in _comms:
        _comms[key] = RingComm(group, transport)
    return _comms[key]


_host_groups: dict[tuple[dist.ProcessGroup, tuple[int, ...]], dist.ProcessGroup] = {}


def host_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    """A gloo group over the ranks of `group` (None: the default group), made once per rank set.

    For the ring's small host-side collectives on an NCCL-only group: an NCCL collective runs on
    a device stream, and reading its result back waits for all GPU work queued before it, which
    costs the host its lead over the GPU (1 ms a call at 8k tokens per rank on 2×H200). Created
    the first time the ranks of `group` ask for it, by those ranks only
    (`use_local_synchronization`), so subgroups of a device mesh each make their own; ranks
    in several such groups must reach their first calls in the same order (as ranks running the
    same layers do), since each creation waits for all of its members.
    """
    group, key = group_key(group)
    if key not in _host_groups:
        _, ranks = key
        _host_groups[key] = dist.new_group(
            list(ranks), timeout=_timeout_of(group), backend="gloo", use_local_synchronization=True
        )
    return _host_groups[key]


def group_key(group: dist.ProcessGroup | None) -> tuple[dist.ProcessGroup, tuple]:
    """`(group, key)`: None made the default group, and a key for what is made once per group
    (host twins, copy-engine transports): its ranks, under the current default group (a
    re-initialised default group gets new ones)."""
    group = group or dist.group.WORLD
    return group, (dist.group.WORLD, tuple(dist.get_process_group_ranks(group)))


def _timeout_of(group: dist.ProcessGroup):
    """`group`'s timeout (its CUDA backend's), so its twin's waits are bounded alike (None: torch's default)."""
    try:
        timeout = group._get_backend(torch.device("cuda")).options._timeout
    except Exception:  # a private API that may change: without it, torch's default timeout
        return None
    return timeout if isinstance(timeout, datetime.timedelta) else None


class NullComm:
    """A stand-in ring with no communication, for measuring compute alone.

    The ring loop runs exactly the kernels rank `rank` of `world` would run, and nothing else:
    `send_recv` leaves `recv` as it is and `wait()` does nothing. So that every step still sees
    finite data, the receive buffers (`buffer`) are kept from call to call, filled with random
    numbers when first made (not zeros: tensor cores draw less power, and clock higher, on
    zeros). Results are meaningless. (A device copy standing in for each transfer was in the
    profile at 8k tokens per rank, W = 2: 0.27 ms of copies, packing included, out of 5.7 ms;
    docs/PERF_NOTES.md, "Where the 8k compute goes".)
    """

    def __init__(self, rank: int, world: int):
        if not 0 <= rank < world:
            raise ValueError(f"rank must be in [0, world={world}), got {rank}")
        self.rank, self.world, self.group, self.transport = rank, world, None, "nccl"
        self._buffers: dict[str, torch.Tensor] = {}  # the latest of each name only

    def send_recv(self, send: torch.Tensor, recv: torch.Tensor, tag: int = 0) -> _Transfer:
        return _Transfer([])

    def buffer(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        buf = self._buffers.get(name)
        if buf is None or buf.shape != tuple(shape) or buf.dtype != dtype or buf.device != torch.device(device):
            buf = self._buffers[name] = torch.randn(shape, device=device).to(dtype)
        return buf

    def keep(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def reserve(self, kv: torch.Tensor) -> None:
        pass

    def all_gather_ints(self, values: list[int]) -> list[list[int]]:
        return [list(values)] * self.world
