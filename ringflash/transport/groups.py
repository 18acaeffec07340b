"""Process-group helpers the transports share: NCCL options, backend names, gloo twins, timeouts.

Plain torch.distributed; nothing here knows about attention or imports the rest of ringflash.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

__all__ = ["backend_names", "grid_of", "group_key", "group_timeout", "host_group", "nccl_options", "register_grid"]


def nccl_options() -> dist.ProcessGroupNCCL.Options:
    """Options for the NCCL group the ring runs on: high-priority streams.

        dist.init_process_group("nccl", pg_options=ringflash.nccl_options())
        # or, for a ("dp", "cp") mesh:
        init_device_mesh("cuda", (dp, cp), mesh_dim_names=("dp", "cp"), backend_override={"cp": nccl_options()})

    (`TORCH_NCCL_HIGH_PRIORITY=1` does the same for every group.) Why: the ring posts a transfer
    before the compute it should hide behind, but the transfer's kernel becomes runnable only
    when the work queued before it ends, together with the next attention kernel; on a
    default-priority stream the GPU hands every SM to that kernel's thousands of blocks first and
    the transfer runs at its tail, exposed.
    """
    if not dist.is_nccl_available():
        raise RuntimeError("nccl_options: this build of torch has no NCCL (use a gloo group on CPU)")
    return dist.ProcessGroupNCCL.Options(is_high_priority_stream=True)


def backend_names(group: dist.ProcessGroup | None) -> set[str]:
    """The backends `group` runs on, e.g. {"gloo"}, {"nccl"} or {"gloo", "nccl"}."""
    # "gloo", "nccl" or a per-device spec such as "cpu:gloo,cuda:nccl".
    spec = str(dist.get_backend(group))
    return {part.split(":")[-1].strip().lower() for part in spec.split(",")}


def group_key(group: dist.ProcessGroup | None) -> tuple[dist.ProcessGroup, tuple]:
    """`(group, key)`: None made the default group, and a key for what is made once per group
    (host twins, copy-engine heaps): its ranks, under the current default group (a
    re-initialised default group gets new ones)."""
    group = group or dist.group.WORLD
    return group, (dist.group.WORLD, tuple(dist.get_process_group_ranks(group)))


_host_groups: dict[tuple, dist.ProcessGroup] = {}


def host_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    """A gloo group over the ranks of `group` (None: the default group), made once per rank set.

    For small host-side collectives on an NCCL-only group: an NCCL collective runs on a device
    stream, and reading its result back waits for all GPU work queued before it, which costs the
    host its lead over the GPU. Created the first time the ranks of `group` ask for it, by those
    ranks only (`use_local_synchronization`), so subgroups of a device mesh each make their own;
    ranks in several such groups must reach their first calls in the same order (as ranks running
    the same layers do), since each creation waits for all of its members.
    """
    group, key = group_key(group)
    if key not in _host_groups:
        _, ranks = key
        _host_groups[key] = dist.new_group(
            list(ranks), timeout=group_timeout(group), backend="gloo", use_local_synchronization=True
        )
    return _host_groups[key]


def group_timeout(group: dist.ProcessGroup | None) -> datetime.timedelta | None:
    """`group`'s timeout (None: the default group's), so that what is made beside it waits as
    long; None where it cannot be read (then torch's default)."""
    group = group or dist.group.WORLD
    for device in ("cuda", "cpu"):  # NCCL's if it has one, else gloo's
        try:
            timeout = group._get_backend(torch.device(device)).options._timeout
        except Exception:  # no such backend, or a private API that changed
            continue
        if isinstance(timeout, datetime.timedelta):
            return timeout
    return None


# The context-parallel group (grid) each registered ring or head group belongs to, by group name.
_grids: dict[tuple, dist.ProcessGroup] = {}


def register_grid(grid: dist.ProcessGroup, *groups: dist.ProcessGroup) -> None:
    """Record that `groups` (a ring group, a head group) are parts of the context-parallel group
    `grid`, so that the cross-rank check (ringflash/agree.py) of a call over any of them runs
    over all of `grid`'s ranks. `ringflash.hybrid_groups` registers what it makes."""
    for g in (grid, *groups):
        _grids[(dist.group.WORLD, g.group_name)] = grid


def grid_of(group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """The grid `group` was registered in (`register_grid`), or None."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    group = group or dist.group.WORLD
    if not isinstance(group, dist.ProcessGroup):
        return None
    return _grids.get((dist.group.WORLD, group.group_name))
