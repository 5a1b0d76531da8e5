"""``torch.compiler.disable`` and ``assume_constant_result``, applied when Dynamo loads instead of when posenc does.

Both import ``torch._dynamo``, which took 1.9 s of ``import posenc``'s 2.6 s past torch's own (torch 2.13, this
repository's CPU machine). Their marks matter only to Dynamo's tracing, and nothing is traced before Dynamo is
imported, so until then the functions stay plain and an import hook applies the marks at the end of
``torch._dynamo``'s own import: ``torch.compile`` then finds them marked, with posenc's reasons. Building the marked
wrappers lazily inside a compiled region instead does not work: Dynamo refuses the call to ``disable`` itself,
without the reason (which tells the user what to pass).
"""

from __future__ import annotations

import importlib.abc
import sys
import threading
import warnings
from collections.abc import Callable
from typing import TypeVar

F = TypeVar("F", bound=Callable)

_DYNAMO = "torch._dynamo"
_pending: list[Callable[[], None]] = []
# One thread may register a mark while another ends Dynamo's import: the check and the append, and the hook's
# removal and the drain, each happen under it, so that no mark waits for a hook that will not fire.
_lock = threading.RLock()


def _hook_installed() -> bool:
    return any(isinstance(f, _DynamoImportHook) for f in sys.meta_path)


def _dynamo_loaded() -> bool:
    # Present in sys.modules but still executing (posenc imported from inside Dynamo's own import) counts as not
    # loaded: the hook, still in place, applies the marks when that import ends.
    return _DYNAMO in sys.modules and not _hook_installed()


def _when_dynamo_loads(apply: Callable[[], None]) -> None:
    with _lock:
        if not _dynamo_loaded():
            _pending.append(apply)
            if not _hook_installed():
                sys.meta_path.insert(0, _DynamoImportHook())
            return
    apply()


def _apply_pending() -> None:
    """Apply the marks waiting for Dynamo; one that fails is a warning, not a failed ``import torch._dynamo`` (the
    function then runs unmarked: traced into, without posenc's reason)."""
    with _lock:
        _remove_hook()
        waiting = _pending[:]
        _pending.clear()
    for apply in waiting:
        try:
            apply()
        except Exception as error:
            warnings.warn(f"posenc could not mark a function for torch.compile: {error!r}", stacklevel=2)


class _MarkingLoader(importlib.abc.Loader):
    """torch._dynamo's own loader, which applies the pending marks once the module has run."""

    def __init__(self, loader: importlib.abc.Loader) -> None:
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        try:
            self.loader.exec_module(module)
        finally:
            # The module keeps its own loader (inspect, linecache and importlib.reload ask it); this one served once.
            module.__loader__ = module.__spec__.loader = self.loader
        _apply_pending()  # which removes the hook; not after a failed import: a second attempt finds it again


class _DynamoImportHook(importlib.abc.MetaPathFinder):
    """Finds torch._dynamo as the finders after it do, and hands it a loader that applies the marks."""

    def find_spec(self, fullname, path, target=None):
        if fullname != _DYNAMO:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _MarkingLoader(spec.loader)
                return spec
        return None


def _remove_hook() -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _DynamoImportHook)]


def disable(*, reason: str, recursive: bool = True) -> Callable[[F], F]:
    """Decorator: ``torch.compiler.disable(fn, recursive=recursive, reason=reason)`` once Dynamo is loaded.

    The marked wrapper replaces ``fn`` under its name in its module, so callers must look it up there at call
    time (a call by the global name in that module does; ``from module import fn`` elsewhere would keep the plain
    function)."""

    def mark(fn: F) -> F:
        import torch

        def marked() -> F:
            return torch.compiler.disable(fn, recursive=recursive, reason=reason)

        if _dynamo_loaded():
            return marked()
        module = sys.modules[fn.__module__]
        _when_dynamo_loads(lambda: setattr(module, fn.__name__, marked()))
        return fn

    return mark


def assume_constant_result(fn: F) -> F:
    """Decorator: ``torch.compiler.assume_constant_result(fn)`` once Dynamo is loaded (it marks ``fn`` itself)."""
    import torch

    _when_dynamo_loads(lambda: torch.compiler.assume_constant_result(fn))
    return fn
