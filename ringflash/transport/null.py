"""A stand-in transport with no communication, for measuring the ring's compute alone."""

from __future__ import annotations

import torch

__all__ = ["NullComm"]


class _Done:
    """A transfer that was never in flight."""

    __slots__ = ()

    def wait(self) -> None:
        pass


class NullComm:
    """A `Transport` (named "null") that moves nothing: the ring as rank `rank` of `world` computes it.

    The ring loop runs exactly the kernels rank `rank` of `world` would run, and nothing else:
    `send_recv` leaves `recv` as it is and `wait()` does nothing (not even a device copy standing
    in for the transfer, which would be timed with the kernels). So that every step still sees
    finite data, the receive buffers (`buffer`) are kept from call to call, filled with random
    numbers when first made (not zeros: tensor cores draw less power, and clock higher, on
    zeros). Results are meaningless.
    """

    name = "null"

    def __init__(self, rank: int, world: int):
        if not 0 <= rank < world:
            raise ValueError(f"rank must be in [0, world={world}), got {rank}")
        self.rank, self.world, self.group = rank, world, None
        self._buffers: dict[str, torch.Tensor] = {}  # the latest of each name only

    def send_recv(self, send: torch.Tensor, recv: torch.Tensor, tag: int = 0) -> _Done:
        return _Done()

    def buffer(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        buf = self._buffers.get(name)
        if buf is None or buf.shape != tuple(shape) or buf.dtype != dtype or buf.device != torch.device(device):
            buf = self._buffers[name] = torch.randn(shape, device=device).to(dtype)
        return buf

    def keep(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def reserve(self, kv: torch.Tensor) -> None:
        pass

    def all_to_all(self, send: torch.Tensor, recv: torch.Tensor, tag: int = 0) -> _Done:
        return _Done()

    def all_gather_ints(self, values: list[int]) -> list[list[int]]:
        return [list(values)] * self.world
