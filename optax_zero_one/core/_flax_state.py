"""Flax's serialization (``flax.serialization.to_bytes``/``from_bytes``, msgpack state dicts) of
the flat buffers in the optimizers' states.

Flax turns a pytree into a state dict through its own registry of types, not through JAX's: a
type it does not know reaches msgpack as is and fails there ("can not serialize 'FlatTree'
object"), so a Linen ``TrainState`` holding 0/1 Adam's state could not be saved with
``to_bytes``. Flax is optional here, and importing it costs a second, so :func:`install`
registers a type with Flax when ``flax.serialization`` is first imported, before or after this
package, and not before.
"""

from __future__ import annotations

import importlib.abc
import sys
from collections.abc import Callable
from typing import Any

_MODULE = "flax.serialization"
_pending: list[tuple[type, Callable, Callable]] = []


def install(
    ty: type, to_state: Callable[[Any], dict], from_state: Callable[[Any, dict], Any]
) -> None:
    """Registers ``ty`` with Flax's serialization now if it is imported, else when it is."""
    module = sys.modules.get(_MODULE)
    if module is not None:
        module.register_serialization_state(ty, to_state, from_state, override=True)
        return
    _pending.append((ty, to_state, from_state))
    if not any(isinstance(f, _RegisterOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegisterOnImport())


def _register_pending(module: Any) -> None:
    while _pending:
        module.register_serialization_state(*_pending.pop(0), override=True)


class _RegisterOnImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when ``flax.serialization`` is imported it asks the other finders
    for it and has its loader register the pending types once the module has run."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != _MODULE:
            return None
        sys.meta_path.remove(self)  # one module, once
        for finder in sys.meta_path:
            spec = getattr(finder, "find_spec", lambda *_: None)(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        run = loader.exec_module

        def exec_module(module: Any) -> None:
            run(module)
            _register_pending(module)

        loader.exec_module = exec_module  # this spec's own loader
        return spec
