"""Several processes for the lab: joining torchrun's process group, and the few collectives the lab uses.

``posenc lab`` launched by ``torchrun`` (WORLD_SIZE > 1 in its environment) joins the group torchrun describes,
on gloo for CPU and nccl for CUDA, and leaves it at the end. The rest of the lab only sees a ``Ranks``: which
process this is, how many there are, and collectives that cost nothing for one process. Every process must see
the same ``--out`` folder (one machine, or a shared filesystem): rank 0 writes, and the others read the weights
it saved.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from posenc._checks import integer
from posenc.lab.store import RunFolderError

# The errors a decision may raise, re-raised by name on every rank: the command tells them apart (a damaged run
# folder is one line and exit 2).
_RERAISED: dict[str, type[Exception]] = {cls.__name__: cls for cls in (ValueError, TypeError, RunFolderError)}

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class Ranks:
    """This process's ``rank`` among ``world_size`` processes of the default process group (0 of 1: alone).

    The collectives below use the default group whenever world_size > 1, so build one with ``Ranks.current()``
    inside an initialised group rather than by hand.
    """

    rank: int = 0
    world_size: int = 1

    def __post_init__(self) -> None:
        for name in ("rank", "world_size"):
            object.__setattr__(
                self, name, integer(f"Ranks.{name}", getattr(self, name), expected="an int", type_error=TypeError)
            )
        if self.world_size < 1:
            raise ValueError(f"Ranks.world_size must be >= 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"Ranks.rank must be in [0, {self.world_size}), got {self.rank}")

    @classmethod
    def current(cls) -> Ranks:
        """The default process group's rank and size, or 0 of 1 when no group is initialised."""
        if dist.is_available() and dist.is_initialized():
            return cls(dist.get_rank(), dist.get_world_size())
        return cls()

    @property
    def is_main(self) -> bool:
        """Rank 0: the one process that writes files, progress bars and status lines."""
        return self.rank == 0

    def batch_slice(self, batch_size: int, *, what: str = "batch_size") -> slice:
        """This rank's contiguous share of a global batch of ``batch_size`` rows.

        Equal shares are what make the mean of the ranks' mean losses the global mean loss (each rank's mean
        is over the same number of tokens), so an uneven split is an error rather than a silent reweighting.
        """
        if batch_size % self.world_size:
            raise ValueError(
                f"{what}={batch_size} is not divisible by the {self.world_size} processes: each rank takes an "
                f"equal slice of every global batch; choose a {what} that is a multiple of {self.world_size} "
                "or change --nproc-per-node"
            )
        share = batch_size // self.world_size
        return slice(self.rank * share, (self.rank + 1) * share)

    def broadcast(self, obj: T) -> T:
        """Rank 0's ``obj`` (picklable) on every rank."""
        if self.world_size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def all_gather(self, obj: T) -> list[T]:
        """Every rank's ``obj`` (picklable), in rank order, on every rank."""
        if self.world_size == 1:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()

    def decide(self, decision: Callable[[], T]) -> T:
        """Rank 0 calls ``decision``; every rank returns its result, or raises the ValueError / TypeError it raised.

        For choices that read files (is this unit done? may this folder be used?): ranks that chose differently
        would then run different collectives and hang, and an error seen on rank 0 alone would leave the others
        waiting.
        """
        if self.world_size == 1:
            return decision()
        outcome: tuple[str, Any] = ("ok", None)
        if self.is_main:
            try:
                outcome = ("ok", decision())
            except (ValueError, TypeError) as error:
                outcome = (type(error).__name__, str(error))
        kind, value = self.broadcast(outcome)
        if kind == "ok":
            return value
        raise _RERAISED.get(kind, ValueError)(value)

    def all_reduce_mean(self, tensor: torch.Tensor) -> torch.Tensor:
        """The element-wise mean of ``tensor`` over ranks (a new tensor on tensor's device)."""
        if self.world_size == 1:
            return tensor
        total = tensor.clone()
        dist.all_reduce(total)
        return total / self.world_size


def rank_label() -> str:
    """' (rank N)' under torchrun, for a message every rank may print (its own error); '' alone."""
    return "" if os.environ.get("WORLD_SIZE", "1") in ("", "1") else f" (rank {os.environ.get('RANK', '0')})"


def resolve_device(device: str, *, world_size: int, local_rank: int) -> tuple[torch.device, str | None]:
    """The device this process uses and the backend of its process group (None: no group, one process).

    Under torchrun each process on a machine takes its own GPU, ``cuda:LOCAL_RANK``, so a device index given
    with several processes is refused rather than shared.
    """
    try:
        resolved = torch.device(device)
    except RuntimeError as error:
        raise ValueError(f"--device {device!r} is not a torch device ({error})") from None
    if world_size == 1:
        return resolved, None
    if resolved.type == "cpu":
        return resolved, "gloo"
    if resolved.type == "cuda":
        if resolved.index is not None:
            raise ValueError(
                f"--device {device} names one GPU, but torchrun started {world_size} processes: pass --device cuda "
                "and each process takes cuda:LOCAL_RANK"
            )
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if 0 < count <= local_rank:
            raise ValueError(
                f"torchrun started this process as LOCAL_RANK {local_rank}, but this machine has {count} CUDA GPU(s) "
                f"and each process takes its own: start at most {count} per machine (--nproc-per-node {count})"
            )
        return torch.device("cuda", local_rank), "nccl"
    raise ValueError(
        f"posenc lab under torchrun runs on cpu (gloo) or cuda (nccl), not on {resolved.type!r}; pass --device cpu "
        "or --device cuda"
    )


def check_device_usable(device: torch.device) -> None:
    """Raise ValueError, naming --device, if this process cannot run on ``device``.

    Called before anything trains or any file is written: without it, a missing GPU surfaces as torch's raw
    "Torch not compiled with CUDA enabled" in the middle of the first unit, after the run folder was claimed.
    """
    if device.type == "cpu":
        return
    if device.type == "meta":
        raise ValueError(f"--device {device} holds no values, so nothing can train or be measured; pass --device cpu")
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            built = "built without CUDA" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
            raise ValueError(
                f"--device {device}: this torch ({torch.__version__}, {built}) sees no CUDA GPU; pass --device cpu, "
                "or run on a machine with a GPU and a CUDA build of torch"
            )
        if device.index is not None and device.index >= count:
            raise ValueError(
                f"--device {device}: this machine has {count} CUDA GPU(s), cuda:0 to cuda:{count - 1}; pass one of "
                "those, or --device cuda"
            )
        return
    try:  # any other backend (mps, xpu, ...): the cheapest honest test is to allocate there
        torch.empty(0, device=device)
    except (RuntimeError, AssertionError) as error:
        # torch's dispatcher error lists every backend over ~50 lines: its first sentence says it.
        first = str(error).strip().splitlines()[0].split(". ")[0] if str(error).strip() else type(error).__name__
        raise ValueError(f"--device {device} is not usable in this process ({first}); pass --device cpu") from None


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} must be an integer (torchrun sets it)") from None


@contextlib.contextmanager
def process_group(device: str) -> Iterator[tuple[Ranks, torch.device]]:
    """Join torchrun's process group for the duration of the block, if this process was started by torchrun.

    Reads WORLD_SIZE and LOCAL_RANK (and, through ``init_process_group``'s env:// method, RANK, MASTER_ADDR and
    MASTER_PORT). With WORLD_SIZE unset or 1 nothing is initialised: ``Ranks()`` and ``torch.device(device)``.
    A device this process cannot use (``--device cuda`` without a GPU) is a ValueError before anything else.
    A group that is already initialised is used as it is and left for its owner to destroy.
    """
    world_size = _env_int("WORLD_SIZE", 1)
    resolved, backend = resolve_device(device, world_size=world_size, local_rank=_env_int("LOCAL_RANK", 0))
    check_device_usable(resolved)
    if backend is None or dist.is_initialized():
        yield Ranks.current(), resolved
        return
    if not dist.is_available():
        raise ValueError("WORLD_SIZE > 1 but this torch was built without torch.distributed")
    if resolved.type == "cuda":
        # Before the group exists, so nccl's communicator and every object collective use this GPU.
        torch.cuda.set_device(resolved)
    dist.init_process_group(backend, device_id=resolved if resolved.type == "cuda" else None)
    try:
        yield Ranks.current(), resolved
    finally:
        dist.destroy_process_group()
