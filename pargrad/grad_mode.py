"""Grad mode: whether operations record a graph for backward.

Grad mode is thread-local, like PyTorch's: a ``no_grad()`` block in one thread never
changes what another thread records. Each thread starts with grad mode enabled.
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections.abc import Callable, Generator
from types import TracebackType
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

class _State(threading.local):
    """Per-thread state, so no lock: ``enabled`` (the flag; a class default, so a new
    thread reads True without a miss) and ``saved`` (the modes to restore when the
    enclosing no_grad / enable_grad blocks exit, innermost last)."""

    enabled = True


mode = _State()
"""The calling thread's grad mode; change it only through the functions and blocks
below. On hot paths read ``not off or mode.enabled`` (see ``off``)."""

off = 0
"""How many threads have grad mode off now: each thread counts itself from before it
turns its mode off until after it turns it on again, so while this thread's mode is off
``off`` is at least 1, whatever other threads do. So ``not off or mode.enabled`` is this
thread's mode, and reads no thread-local while no thread is in a no_grad block or a
backward (a thread-local attribute read costs ~60-110 ns, a module's ~10). A thread
that ends with its mode off leaves ``off`` above 0: the reads are then only slower."""
_off_lock = threading.Lock()
"""Guards ``off``'s updates (a read is one load)."""


def is_grad_enabled() -> bool:
    """Return True if operations in the calling thread currently record a graph."""
    return not off or mode.enabled


def _set_enabled(flag: bool) -> None:
    global off
    flag = bool(flag)
    if flag is mode.enabled:
        return
    if flag:
        mode.enabled = True
        with _off_lock:
            off -= 1
    else:
        with _off_lock:
            off += 1
        mode.enabled = False


def _saved_modes() -> list[bool]:
    saved: list[bool] | None = getattr(mode, "saved", None)
    if saved is None:
        saved = mode.saved = []
    return saved


class ModeContext:
    """Base for switches of a thread-local mode (grad mode here, anomaly mode in
    anomaly.py) usable as context managers and as decorators.

    A subclass says how to read and set the calling thread's mode (``_read``,
    ``_write``) and where the thread keeps the modes to restore (``_saved``: a list,
    innermost last); an instance switches to ``_mode``. The mode to restore is kept per
    thread, so one instance may be entered by several threads at once (or re-entered)
    without mixing up their modes.
    """

    _mode: Any

    @staticmethod
    def _read() -> Any:
        raise NotImplementedError

    @staticmethod
    def _write(mode: Any, /) -> None:
        raise NotImplementedError

    @staticmethod
    def _saved() -> list[Any]:
        raise NotImplementedError

    def __enter__(self) -> None:
        self._saved().append(self._read())
        self._write(self._mode)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._write(self._saved().pop())

    def __call__(self, func: F) -> F:
        """Use as a decorator: every call of ``func`` runs under this mode; for a
        generator function, every step of the generator (as in PyTorch), while the code
        that iterates it keeps its own mode."""
        if inspect.isgeneratorfunction(func):
            return self._wrap_generator(func)  # type: ignore[return-value]

        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with self._fresh():
                return func(*args, **kwargs)

        return wrapper  # type: ignore[return-value]

    def _wrap_generator(self, func: Callable[..., Generator[Any, Any, Any]]) -> Callable[..., Any]:
        @functools.wraps(func)
        def generator(*args: Any, **kwargs: Any) -> Generator[Any, Any, Any]:
            gen = func(*args, **kwargs)
            try:
                with self._fresh():
                    response = gen.send(None)
                while True:
                    try:
                        request = yield response
                    except GeneratorExit:
                        with self._fresh():
                            gen.close()
                        raise
                    except BaseException as exc:  # thrown in: the body handles it
                        with self._fresh():
                            response = gen.throw(exc)
                    else:
                        with self._fresh():
                            response = gen.send(request)
            except StopIteration as stop:
                return stop.value

        return generator

    def _fresh(self) -> ModeContext:
        return self  # the saved modes live in the thread, so one instance serves all calls


class SetModeContext(ModeContext):
    """A switch that sets its mode as soon as it is created, as ``torch.set_grad_enabled``
    does: a plain call sets the mode; as a context manager it restores the mode it found
    on exit; as a decorator, creating it leaves the mode unchanged and every call of the
    function runs under the mode. An instance belongs to the thread that created it.
    A subclass's ``__init__`` calls ``_start(mode)``.
    """

    _previous: Any

    def _start(self, mode: Any) -> None:
        self._mode = mode
        self._previous = self._read()
        self._write(mode)

    def __enter__(self) -> None:
        # The mode was already set by _start; nothing more to do.
        pass

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._write(self._previous)

    def __call__(self, func: F) -> F:
        # Used as a decorator, creating this object must not leave the mode changed.
        self._write(self._previous)
        return super().__call__(func)

    def _fresh(self) -> ModeContext:
        fresh = object.__new__(type(self))  # each call sets (and restores) the mode anew
        fresh._start(self._mode)
        return fresh


class _GradModeContext(ModeContext):
    """Base for grad-mode switches: the mode is ``is_grad_enabled()``."""

    _read = staticmethod(is_grad_enabled)
    _write = staticmethod(_set_enabled)
    _saved = staticmethod(_saved_modes)


class _BareDecorator(_GradModeContext):
    """A switch that also decorates without parentheses: ``@no_grad`` as ``@no_grad()``."""

    def __new__(cls, func: Callable[..., Any] | None = None) -> Any:
        if func is None:
            return super().__new__(cls)
        return cls()(func)


class no_grad(_BareDecorator):
    """Context manager and decorator (with or without parentheses) that disables graph
    recording in this thread; on a generator function it applies to the generator's
    body, step by step.

    >>> import pargrad
    >>> x = pargrad.tensor([1.0, 2.0], requires_grad=True)
    >>> with pargrad.no_grad():
    ...     y = x * 2
    >>> y.requires_grad
    False
    """

    _mode = False


class enable_grad(_BareDecorator):
    """Context manager and decorator (with or without parentheses) that enables graph
    recording in this thread (see ``no_grad``)."""

    _mode = True


class set_grad_enabled(SetModeContext, _GradModeContext):
    """Set grad mode for this thread; as a context manager, restore it on exit; as a
    decorator, run every call of the function under it.

    Like ``torch.set_grad_enabled``: the mode changes as soon as the object is
    created, so ``pargrad.set_grad_enabled(False)`` works as a plain call too. An
    instance belongs to the thread that created it.
    """

    def __init__(self, mode: bool) -> None:
        self._start(bool(mode))
