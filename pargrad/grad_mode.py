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
from typing import TYPE_CHECKING, Any, TypeVar, overload

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


class _Switchable(type):
    """Metaclass of the mode switches: ``Switch(func)``, a class applied to a function
    as a bare decorator (``@no_grad``), means ``Switch()(func)``."""

    _bare: bool

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and not kwargs and callable(args[0]) and cls._bare:
            return super().__call__()(args[0])
        return super().__call__(*args, **kwargs)


class ModeContext(metaclass=_Switchable):
    """Base for switches of a thread-local mode (grad mode here, anomaly mode in
    anomaly.py) usable as context managers and as decorators.

    A subclass says how to read and set the calling thread's mode (``_read``,
    ``_write``) and where the thread keeps the modes to restore (``_saved``: a list,
    innermost last); an instance switches to ``_mode``. The mode to restore is kept per
    thread, so one instance may be entered by several threads at once (or re-entered)
    without mixing up their modes. ``_bare``: the class itself decorates a function.
    """

    _mode: Any
    _bare = False

    @staticmethod
    def _read() -> Any:
        raise NotImplementedError

    @staticmethod
    def _write(mode: Any, /) -> None:
        raise NotImplementedError

    @staticmethod
    def _saved() -> list[Any]:
        raise NotImplementedError

    def _switch_in(self, mode: Any) -> None:
        """Switch to ``mode``, remembering the mode found on this thread's stack."""
        self._saved().append(self._read())
        self._write(mode)

    def _switch_back(self) -> None:
        self._write(self._saved().pop())

    def __enter__(self) -> None:
        self._switch_in(self._mode)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._switch_back()

    def _for_each_call(self) -> ModeContext:
        """The switch a decorated function enters on each call: this one (its modes to
        restore live in the thread, so one instance serves every call and thread)."""
        return self

    def __call__(self, func: F) -> F:
        """Use as a decorator: every call of ``func`` runs under this mode; for a
        generator function, each step of the generator's body does (the code that
        drives the generator keeps its own mode in between)."""
        switch = self._for_each_call()
        if inspect.isgeneratorfunction(func):
            def start(*args: Any, **kwargs: Any) -> _StepsUnder:
                return _StepsUnder(func(*args, **kwargs), switch)
            return functools.update_wrapper(start, func)  # type: ignore[return-value]

        def call(*args: Any, **kwargs: Any) -> Any:
            with switch:
                return func(*args, **kwargs)
        return functools.update_wrapper(call, func)  # type: ignore[return-value]


class _StepsUnder(Generator[Any, Any, Any]):
    """A generator whose every step (send, throw, close) runs inside ``switch``: what a
    switch makes of a generator function it decorates. Its ``StopIteration`` carries the
    body's return value, so ``yield from`` sees it."""

    __slots__ = ("_body", "_switch")

    def __init__(self, body: Generator[Any, Any, Any], switch: ModeContext) -> None:
        self._body = body
        self._switch = switch

    def send(self, value: Any) -> Any:
        with self._switch:
            return self._body.send(value)

    def throw(self, *exc: Any) -> Any:
        with self._switch:
            return self._body.throw(*exc)

    def close(self) -> None:
        with self._switch:
            self._body.close()


class SetModeContext(ModeContext):
    """A switch that sets its mode as soon as it is created, as ``torch.set_grad_enabled``
    does: a plain call sets the mode; as a context manager it restores the mode it found
    on exit; as a decorator, creating it leaves the mode unchanged and every call of the
    function runs under the mode. An instance belongs to the thread that created it.
    A subclass's ``__init__`` calls ``_start(mode)``.
    """

    _found: Any  # the thread's mode when this switch was made

    def _start(self, mode: Any) -> None:
        self._mode, self._found = mode, self._read()
        self._write(mode)

    def __enter__(self) -> None:
        return None  # _start switched already

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._write(self._found)

    def __call__(self, func: F) -> F:
        self._write(self._found)  # as a decorator it changes nothing until func is called
        return super().__call__(func)

    def _for_each_call(self) -> ModeContext:
        return _Scoped(self)


class _Scoped(ModeContext):
    """``owner``'s mode for one block at a time, restored from the thread's stack."""

    def __init__(self, owner: ModeContext) -> None:
        self._mode = owner._mode
        self._read, self._write, self._saved = (  # type: ignore[method-assign]
            owner._read, owner._write, owner._saved)


class _GradModeContext(ModeContext):
    """Base for grad-mode switches: the mode is ``is_grad_enabled()``."""

    _read = staticmethod(is_grad_enabled)
    _write = staticmethod(_set_enabled)
    _saved = staticmethod(_saved_modes)


S = TypeVar("S", bound="_BareSwitch")


class _BareSwitch(_GradModeContext):
    """A grad-mode switch whose class also decorates: ``@no_grad`` as ``@no_grad()``
    (done by ``_Switchable``; the signatures below only tell type checkers so)."""

    _bare = True

    if TYPE_CHECKING:
        @overload
        def __new__(cls: type[S]) -> S: ...
        @overload
        def __new__(cls, func: F, /) -> F: ...  # type: ignore[misc]
        def __new__(cls, *func: Any) -> Any: ...


class no_grad(_BareSwitch):
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


class enable_grad(_BareSwitch):
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
