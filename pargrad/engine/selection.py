"""Which engine runs a backward call: the process-wide default and ``current_engine``.

The default is made on first use from ``PARGRAD_ENGINE``, so this module imports both
engines; it sits above them (``engine/base.py`` holds only the interface they implement
and the thread's ``use_engine`` stack, which the engines push themselves on). It also
tells a large elementwise call which idle threads may help with its chunks: the current
engine's (``Engine.intra_op_helpers``, pargrad/parallel.py).
"""

from __future__ import annotations

import os
import threading

from pargrad.engine.base import Engine, _engine_stack
from pargrad.engine.sequential import SequentialEngine
from pargrad.engine.threaded import ThreadedEngine
from pargrad.parallel import Helpers, set_helpers_finder

# Guards _default_engine, so that creating the default lazily cannot overwrite a
# concurrent set_default_engine.
_default_lock = threading.Lock()
_default_engine: Engine | None = None


ENGINE_VARIABLE = "PARGRAD_ENGINE"
"""The environment variable that picks the default engine: ``threaded`` (the default)
or ``sequential`` (the reference, for debugging). Read when the default is first made."""


def get_default_engine() -> Engine:
    """The process-wide default engine. Thread-safe.

    A ``ThreadedEngine`` with the default workers, unless ``set_default_engine`` chose
    another, or the environment variable ``PARGRAD_ENGINE`` is ``sequential`` (then a
    ``SequentialEngine``). Raises ValueError if ``PARGRAD_ENGINE`` has another value.

    >>> import pargrad
    >>> isinstance(pargrad.get_default_engine(), pargrad.Engine)
    True
    """
    global _default_engine
    with _default_lock:
        if _default_engine is None:
            _default_engine = _engine_from_environment()
        return _default_engine


def _engine_from_environment() -> Engine:
    choice = os.environ.get(ENGINE_VARIABLE, "threaded").strip().lower()
    if choice in ("", "threaded"):
        return ThreadedEngine()
    if choice == "sequential":
        return SequentialEngine()
    raise ValueError(
        f"{ENGINE_VARIABLE}={os.environ[ENGINE_VARIABLE]!r} is not an engine; use "
        f"'threaded' (the default) or 'sequential' (the reference engine)"
    )


def set_default_engine(engine: Engine) -> None:
    """Make ``engine`` the process-wide default for backward calls. Thread-safe.

    Threads inside a ``use_engine`` block keep their engine. Raises TypeError if
    ``engine`` is not an Engine.
    """
    global _default_engine
    if not isinstance(engine, Engine):
        raise TypeError(f"expected a pargrad Engine, got {type(engine).__name__}")
    with _default_lock:
        _default_engine = engine


def current_engine() -> Engine:
    """The engine a backward call made now by this thread would use (without ``engine=``).

    >>> import pargrad
    >>> engine = pargrad.SequentialEngine()
    >>> with pargrad.use_engine(engine):
    ...     pargrad.current_engine() is engine
    True
    """
    stack = _engine_stack()
    return stack[-1] if stack else get_default_engine()


def _intra_op_helpers() -> Helpers | None:
    """The idle threads a large elementwise call may offer chunks to: the current
    engine's (pargrad/parallel.py)."""
    try:
        engine = current_engine()
    except ValueError:  # a bad PARGRAD_ENGINE: the next backward says so, not a forward
        return None
    return engine.intra_op_helpers()


set_helpers_finder(_intra_op_helpers)
