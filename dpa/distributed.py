"""Data-parallel runs under ``torchrun``: which part of the work is this process's, through torch.distributed.

``torchrun --nproc-per-node N -m dpa attribute --prompts FILE --out DIR`` (or ``evaluate`` / ``sweep``) starts N
processes with ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK`` set. ``group()`` joins them into one process group
(NCCL on CUDA, each rank on the GPU ``LOCAL_RANK``; gloo on CPU); each rank takes every N-th item of the
work, writes its own part, and rank 0 merges the parts once ``barrier()`` says every rank is done. dpa keeps no
scheme of its own beyond reading the rank and the world size. A plain ``python -m dpa ...`` is rank 0 of 1.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Iterator

import torch

from .errors import InputError


@dataclass(frozen=True)
class Group:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        """Rank 0: the one that merges and writes the summary."""
        return self.rank == 0

    def mine(self, index: int) -> bool:
        """Whether item ``index`` of the work (in the order every rank sees) is this rank's."""
        return index % self.world == self.rank

    def barrier(self) -> None:
        if self.world > 1:
            torch.distributed.barrier()

    def all_ok(self, ok: bool) -> bool:
        """Whether every rank says ``ok`` (so that all stop together when one fails, instead of waiting)."""
        if self.world == 1:
            return ok
        flag = torch.tensor([0 if ok else 1], device=_device())
        torch.distributed.all_reduce(flag)
        return int(flag.item()) == 0

    def stop_together(self, failed: BaseException | None) -> None:
        """Raise on every rank if one failed (``failed``: this rank's error, or None): its error on that rank, a
        pointer to it on the others, so that none waits for ever at the next collective."""
        if not self.all_ok(failed is None):
            if failed is not None:
                raise failed
            raise InputError("another rank of this torchrun failed; see its message")


SINGLE = Group()


def _device() -> torch.device:
    if torch.distributed.is_initialized() and torch.distributed.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def current() -> Group:
    """This process's place: from an initialised process group, else rank 0 of 1."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return Group(torch.distributed.get_rank(), torch.distributed.get_world_size(),
                     int(os.environ.get("LOCAL_RANK", torch.distributed.get_rank())))
    return SINGLE


@contextlib.contextmanager
def group() -> Iterator[Group]:
    """Join the process group ``torchrun`` describes (``WORLD_SIZE`` > 1), for the duration of the block;
    a process group initialised by the caller is used as it is. Outside torchrun: rank 0 of 1."""
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world <= 1 or (torch.distributed.is_available() and torch.distributed.is_initialized()):
        yield current()
        return
    if not torch.distributed.is_available():
        raise InputError("WORLD_SIZE is set but this torch has no torch.distributed")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        if local >= torch.cuda.device_count():
            raise InputError(f"LOCAL_RANK {local} but this machine has {torch.cuda.device_count()} GPU(s); start "
                             "torchrun with --nproc-per-node at most the number of GPUs")
        torch.cuda.set_device(local)
        backend = "nccl"
    else:
        backend = "gloo"
    torch.distributed.init_process_group(backend=backend)
    try:
        yield current()
    finally:
        torch.distributed.destroy_process_group()


def device_for(group_: Group, device: str | None) -> str | None:
    """The device a rank loads the model on: the GPU of its ``LOCAL_RANK`` under torchrun with CUDA (unless
    the user named one), else what was asked."""
    if device is None and group_.world > 1 and torch.cuda.is_available():
        return f"cuda:{group_.local_rank}"
    return device
