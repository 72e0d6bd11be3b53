"""Injecting Ctrl-C at chosen points of chosen functions, for the interrupt tests.

``SigintAt(codes, n)`` is a trace function (``sys.settrace``) that raises SIGINT
(``signal.raise_signal``, so the Python handler installed decides what happens, exactly
as for a real Ctrl-C) at the ``n``-th *signal point* executed in the code objects
``codes`` on the calling thread, once.

Signal points: CPython runs a signal's Python handler only between bytecodes where its
eval loop checks for pending work: on entry to a function, at a loop's back edge
(``JUMP_BACKWARD``), and right after a call returns (``CALL``, ``CALL_FUNCTION_EX``, and
from 3.13 ``CALL_KW``, a call with keyword arguments);
a blocking call that is interrupted (a lock's acquire, ``Event.wait``) raises from that
call, i.e. at the same point. Those are the bytecode boundaries where a Ctrl-C can land,
so they are the ones injected into. ``every_bytecode=True`` injects at every bytecode
instead, which is stronger than any signal and raises where nothing but a trace
function can: CPython 3.11 leaves the ``NOP`` of a ``try:`` line and the normal exit of
a ``with`` block (its ``LOAD_CONST None`` x3 before the ``__exit__`` call) out of the
exception table, so an exception injected there skips the handler, and even
``with lock:`` leaks the lock (bpo-29988). The engine's tests use signal points.
"""

from __future__ import annotations

import dis
import importlib
import signal
import sys
from types import CodeType, FrameType
from typing import Any

_CHECKS = ("CALL", "CALL_KW", "CALL_FUNCTION_EX", "JUMP_BACKWARD")


def code_objects(names: list[tuple[str, str]]) -> set[CodeType]:
    """The code objects of the functions named as (module, qualified name); names that
    do not exist (in another version of the code) are skipped."""
    found = set()
    for module, qualname in names:
        obj: Any = importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part, None)
        if obj is not None:
            found.add(obj.__code__)
    return found


class SigintAt:
    """The trace function; ``fired`` says whether it raised its SIGINT, ``where`` at
    which (function name, bytecode offset)."""

    def __init__(self, codes: set[CodeType], n: int, every_bytecode: bool = False) -> None:
        self.codes = codes
        self.n = n
        self.every_bytecode = every_bytecode
        self.count = 0
        self.fired = False
        self.where: tuple[str, int] | None = None
        self._previous: dict[int, str] = {}  # per frame: the opname executed last

    def __call__(self, frame: FrameType, event: str, arg: Any) -> Any:
        if frame.f_code not in self.codes or self.fired:
            return None
        frame.f_trace_opcodes = True
        self._point(frame, -1)  # function entry
        return self._local

    def _local(self, frame: FrameType, event: str, arg: Any) -> Any:
        if self.fired:
            return None
        # From 3.12 on, the flag set at the call event is not seen until it is set again
        # from the frame's own trace function (at its first line event, before any opcode).
        frame.f_trace_opcodes = True
        if event == "opcode":
            code = frame.f_code.co_code
            previous = self._previous.get(id(frame))
            self._previous[id(frame)] = dis.opname[code[frame.f_lasti]]
            if self.every_bytecode or previous in _CHECKS:
                self._point(frame, frame.f_lasti)
        elif event == "return":
            self._previous.pop(id(frame), None)
        return self._local

    def _point(self, frame: FrameType, offset: int) -> None:
        self.count += 1
        if self.count == self.n:
            self.fired = True
            self.where = (frame.f_code.co_qualname, offset)
            sys.settrace(None)
            frame.f_trace = None
            signal.raise_signal(signal.SIGINT)
