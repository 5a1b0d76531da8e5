"""The launches of the fused kernels made inside a block, per thread: what ``posenc.kernels.replay`` makes its plans
of. Each kernel's launcher calls ``record`` with its own kind of launch (the CPU kernel's packed ``struct Args``,
``cpu_rope.Launch``; Triton's planned ``triton_rope.Launch``); outside a block that costs one attribute read."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator


class _Recording(threading.local):
    """Per thread: the launches of the innermost open ``recording_launches`` block, or None. A class default, since
    looking up an attribute a thread never set is slow (~1 us)."""

    launches: list[object] | None = None


_local = _Recording()


@contextlib.contextmanager
def recording_launches() -> Iterator[list[object]]:
    """The launches of the fused kernels made in this thread inside the block (nested blocks each see theirs)."""
    outer = _local.launches
    launches: list[object] = []
    _local.launches = launches
    try:
        yield launches
    finally:
        _local.launches = outer
        if outer is not None:
            outer.extend(launches)


def record(launch: object) -> None:
    """Called by every launch of a fused kernel: kept where a ``recording_launches`` block is open in this thread."""
    launches = _local.launches
    if launches is not None:
        launches.append(launch)
