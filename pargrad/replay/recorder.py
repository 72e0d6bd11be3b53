"""What ``pargrad.capture`` sees while a function runs for the first time: a ``Recorder``.

The places that make tensors tell the recorder of their thread what they did, as long as
one records (``active`` is the count of recordings in progress, so that everyone else
pays one check of a module global):

- ``Op.call`` and ``Op.outputs``: an op, its operands and parameters, its outputs and
  the node it recorded (``note_op``);
- ``pargrad.ops.core.constant``: a numpy function whose result carries no gradient
  (comparisons: ``x > 0``), ``Tensor.detach``, random draws (``note_call``,
  ``note_detach``, ``note_random``): they run again on each replay;
- ``Tensor(data)`` and the creation functions (``zeros``...), made from Python or numpy
  values: a constant of the recording (``note_constant``);
- ``Tensor._make`` on any thread (``note_made``): a tensor that none of the above
  claims, used later or returned, was made by a path the recording cannot replay.

Whatever would make a replay differ from calling the function again (a value read back
into Python, a hook registered, an in-place change, a backward inside the function, a
tensor of unknown origin) ends the recording's usefulness: ``fail`` keeps the first
reason and the user's line that caused it, and the function then runs eagerly.

This module knows nothing of ops or tensors beyond the attributes it reads; the
program made from a recording is pargrad/replay/program.py's.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

active = 0
"""How many recordings are in progress, on any thread (guarded by ``_lock``; read
without it: a stale read only costs a call that finds no recorder)."""
_lock = threading.Lock()
_recorders: list[Recorder] = []  # the recordings in progress; guarded by _lock


class _Local(threading.local):
    recorder: Recorder | None = None  # the innermost recording of this thread
    outer: tuple[Recorder | None, ...] = ()  # the recordings it is nested in


_local = _Local()

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def user_line() -> str:
    """``file:line`` of the innermost frame outside pargrad (and outside the methods
    pargrad generates, ``<string>``): the user's line that called into pargrad."""
    frame = sys._getframe(1)
    while frame is not None and (frame.f_code.co_filename.startswith(_PACKAGE)
                                 or frame.f_code.co_filename == "<string>"):
        frame = frame.f_back  # type: ignore[assignment]
    if frame is None:
        return "<unknown>"
    return f"{frame.f_code.co_filename}:{frame.f_lineno}"


Spec = tuple[str, Any]
"""An operand of a recorded call: ``("slot", n)`` for the value in slot ``n``,
``("value", v)`` for a value the recording keeps as it is."""


class Instr:
    """One recorded call: ``kind`` is ``"op"``, ``"call"`` (a numpy function of
    ``operands``), ``"random"`` (``fn()`` draws fresh values) or ``"detach"``."""

    __slots__ = ("fn", "kind", "node", "operands", "outs", "params", "path", "pspec", "raw",
                 "saved")

    def __init__(self, kind: str, fn: Any, operands: tuple[Spec, ...], params: dict[str, Any],
                 outs: tuple[int, ...], node: Any = None, raw: bool = False,
                 pspec: dict[str, Any] | None = None) -> None:
        self.kind = kind
        self.fn = fn  # the Op, the numpy function or the drawing function
        self.operands = operands
        self.params = params
        self.outs = outs  # the slots of its outputs
        self.node = node  # the op's backward node at the recording (None: it made none)
        self.raw = raw  # whether the forward returned something that is not an ndarray
        self.path = "outputs"  # an op's: the path of Op.call or Op.outputs that ran it
        # The parameters that hold values of the recording (an index array made from a
        # tensor), as operand specs in nested tuples (None: every one is a constant).
        self.pspec = pspec
        # What the node had saved when the recording ended: ``(saved_arrays, saved_ans,
        # saved_versions)`` (a backward frees them from the node; the program is made
        # from this snapshot, on the first replay).
        self.saved: tuple[Any, Any, Any] = (None, None, ())


class Recorder:
    """The notes of one recording, taken on one thread.

    Slots number the values of the recording: the arguments' arrays and the outside
    tensors' arrays (``inputs``), constants, and every output of a recorded call
    (``values[n]`` is slot ``n``'s value at the recording)."""

    def __init__(self, arg_tensors: list[Any], arg_arrays: list[np.ndarray],
                 start_nr: int) -> None:
        self.thread = threading.get_ident()
        # The sequence number when it started: a node numbered from it on was made while
        # recording.
        self.start_nr = start_nr
        self.values: list[Any] = []
        self.inputs: list[tuple[str, Any]] = []  # per input slot: ("arg", i) / ("ext", t)
        self.input_slots: list[int] = []
        self.input_tensor: dict[int, Any] = {}  # input slot -> its tensor (arguments, outside)
        self.const_slots: dict[int, np.ndarray] = {}
        self.instrs: list[Instr] = []
        self.slot: dict[int, int] = {}  # id(tensor) -> slot (arguments, outside, made)
        self.tensor: dict[int, Any] = {}  # id(tensor) -> the tensor (keeps ids unique)
        self.array_slot: dict[int, int] = {}  # id(argument array) -> slot
        self.made: set[int] = set()  # ids of tensors made while recording (any thread)
        self.failure: str | None = None
        self.where: str | None = None
        self.guards: list[tuple[Any, ...]] = []  # the outside tensors', made by finish
        # Python values the function read that a replay checks: (read, value seen).
        self.value_guards: list[tuple[Callable[[], Any], Any]] = []
        for i, t in enumerate(arg_tensors):
            if id(t) not in self.slot:
                n = self.slot[id(t)] = self._input(("arg", i), t.data)
                self.tensor[id(t)] = t
                self.input_tensor[n] = t
        for i, a in enumerate(arg_arrays):
            if id(a) not in self.array_slot:
                self.array_slot[id(a)] = self._input(("array", i), a)

    def _input(self, what: tuple[str, Any], value: Any) -> int:
        n = len(self.values)
        self.values.append(value)
        self.array_slot.setdefault(id(value), n)
        self.inputs.append(what)
        self.input_slots.append(n)
        return n

    def _new(self, value: Any) -> int:
        self.values.append(value)
        n = len(self.values) - 1
        self.array_slot.setdefault(id(value), n)
        return n

    def fail(self, reason: str) -> None:
        """Keep the first reason the recording cannot be replayed, with the user's line."""
        if self.failure is None:
            self.failure = reason
            self.where = user_line()

    # ----- operands -----

    def spec(self, value: Any) -> Spec:
        """How a recorded call's operand is found on replay."""
        cls = type(value)
        if cls is float or cls is int:  # the most common constants
            return ("value", value)
        if isinstance(value, _tensor[0]):
            n = self.slot.get(id(value))
            return ("slot", n if n is not None else self._outside(value))
        if isinstance(value, np.ndarray):
            n = self.array_slot.get(id(value))
            if n is not None:  # a tensor's array itself (``x * h.data``): its slot
                return ("slot", n)
            self._check_view(value)
        elif isinstance(value, (list, tuple)) and any(isinstance(v, _tensor[0]) for v in value):
            self.fail("a list of tensors is an operand")
        return ("value", value)

    def _check_view(self, value: Any) -> None:
        """Fail if ``value``, an array the recording would keep as a constant, shares
        memory with a value of the recording (a view of an argument's array, or of a
        tensor's ``.data``): it would not follow the next call's values."""
        if isinstance(value, np.ndarray) and any(
                isinstance(v, np.ndarray) and np.may_share_memory(v, value)
                for v in self.values):
            self.fail("a numpy view of an argument's or a tensor's array is used as a "
                      "constant")

    def _outside(self, tensor: Any) -> int:
        """The slot of a tensor the recording meets for the first time: an outside tensor,
        unless it was made while recording by something that did not tell the recording."""
        if id(tensor) in self.made:
            self.fail("a tensor made inside the function by a call that capture cannot "
                      "replay (a custom Function, or another thread's op) is used")
        elif tensor.requires_grad and tensor.grad_fn is not None and (
                tensor.grad_fn.sequence_nr >= self.start_nr):
            self.fail("a tensor whose graph was made while recording, outside this "
                      "thread's recorded ops, is used")
        n = self.slot[id(tensor)] = self._input(("ext", tensor), tensor.data)
        self.tensor[id(tensor)] = tensor
        self.input_tensor[n] = tensor
        return n

    def _outs(self, tensors: tuple[Any, ...]) -> tuple[int, ...]:
        outs = []
        for t in tensors:
            n = self._new(t.data)
            self.slot[id(t)] = n
            self.tensor[id(t)] = t
            outs.append(n)
        return tuple(outs)

    # ----- notes -----

    def finish(self) -> None:
        """The recording is over: keep what each node saved (the program is made from it
        later), and let go of the tensors, which were held only to keep their ids."""
        for instr in self.instrs:
            node = instr.node
            if node is not None:
                instr.saved = (getattr(node, "saved_arrays", None),
                               getattr(node, "saved_ans", None),
                               getattr(node, "saved_versions", ()))
        self.tensor = {}
        # The outside tensors' guards as they were (checked by every replay).
        self.guards = [(t.data.shape, t.data.dtype, t._device, t._requires_grad)
                       for kind, t in self.inputs if kind == "ext"]

    def _pspec(self, value: Any) -> Any:
        if isinstance(value, np.ndarray):
            return self.spec(value)
        if isinstance(value, tuple):
            return ("tuple", tuple(self._pspec(v) for v in value))
        return ("value", value)

    def note_op(self, op: Any, args: tuple[Any, ...], params: dict[str, Any],
                tensors: tuple[Any, ...], raw: bool, path: str = "outputs") -> None:
        operands = tuple([self.spec(a) for a in args])
        node = tensors[0].grad_fn if tensors else None
        pspec = None
        if params and any(isinstance(v, (np.ndarray, tuple)) for v in params.values()):
            pspec = {k: self._pspec(v) for k, v in params.items()}
            if all(spec[0] == "value" or (spec[0] == "tuple" and not _has_slot(spec))
                   for spec in pspec.values()):
                pspec = None
        instr = Instr("op", op, operands, params, self._outs(tensors), node, raw, pspec)
        instr.path = path
        self.instrs.append(instr)

    def derive(self, fn: Callable[..., np.ndarray], sources: tuple[Any, ...],
               result: np.ndarray) -> None:
        """``result`` is ``fn`` of the arrays of ``sources`` (tensors or arrays): where one
        is a value of the recording, a replay computes it again."""
        if not any(isinstance(s, _tensor[0]) or id(s) in self.array_slot for s in sources):
            for s in sources:
                self._check_view(s)
            return  # made from constants: a constant
        operands = tuple(self.spec(s) for s in sources)
        self.instrs.append(Instr("call", fn, operands, {}, (self._new(result),)))

    def note_call(self, fn: Callable[..., Any], args: tuple[Any, ...], out: Any) -> None:
        operands = tuple(self.spec(a) for a in args)
        self.instrs.append(Instr("call", fn, operands, {}, self._outs((out,))))

    def note_detach(self, source: Any, out: Any) -> None:
        self.instrs.append(Instr("detach", None, (self.spec(source),), {}, self._outs((out,))))

    def note_random(self, draw: Callable[[], np.ndarray], out: Any) -> None:
        if out.requires_grad:
            self.fail("a random tensor that requires grad is made inside the function "
                      "(a new leaf on every call)")
        self.instrs.append(Instr("random", draw, (), {}, self._outs((out,))))

    def note_constant(self, out: Any, source: Any) -> None:
        """``out = Tensor(source)``: a constant, unless ``source`` is a value of the
        recording (a tensor, or a tensor's array), which a replay copies again."""
        if out.requires_grad:
            self.fail("a tensor that requires grad is made inside the function (a new leaf "
                      "on every call)")
        if isinstance(source, _tensor[0]) or id(source) in self.array_slot:
            dtype = out.data.dtype
            operands = (self.spec(source),)
            self.instrs.append(Instr("call", lambda a: np.array(a, dtype=dtype), operands, {},
                                     self._outs((out,))))
            return
        self._check_view(source)
        n = self._outs((out,))[0]
        self.const_slots[n] = out.data


class Returned:
    """What a recording keeps of a tensor ``fn`` returned, as it was when ``fn`` returned
    (the tensor itself may change after: ``loss += penalty``)."""

    __slots__ = ("data", "device", "grad_fn", "output_nr", "slot")

    def __init__(self, recorder: Recorder, tensor: Any) -> None:
        self.slot = recorder.slot.get(id(tensor), -1)
        self.grad_fn = tensor.grad_fn
        self.output_nr = tensor.output_nr
        self.device = tensor._device
        self.data = tensor.data


def start(recorder: Recorder) -> None:
    """Make ``recorder`` the recording of the calling thread."""
    global active
    with _lock:
        _recorders.append(recorder)
        active = len(_recorders)
    _local.outer = (*_local.outer, _local.recorder)
    _local.recorder = recorder


def stop(recorder: Recorder) -> None:
    """End the calling thread's recording: the one it was nested in, if any, goes on."""
    global active
    _local.recorder, _local.outer = _local.outer[-1], _local.outer[:-1]
    with _lock:
        _recorders.remove(recorder)
        active = len(_recorders)


_tensor: list[Any] = [type(None)]
"""The Tensor class, bound by tensor.py at import (``bind_tensor``): this module is
imported by the modules below tensor.py and imports none of pargrad's."""


def bind_tensor(cls: type) -> None:
    """Tell the recorder which class is pargrad's Tensor (tensor.py, at import)."""
    _tensor[0] = cls


def after_fork_in_child() -> None:
    """In a child process (fork.py, ``_lock`` held): only the forking thread is left,
    and only its recording goes on."""
    global active
    _recorders[:] = [r for r in (*_local.outer, _local.recorder) if r is not None]
    active = len(_recorders)


def current() -> Recorder | None:
    """The calling thread's recording, if one is in progress."""
    return _local.recorder if active else None


def note_made(tensor: Any) -> None:
    """``Tensor._make`` made ``tensor`` while some thread records."""
    with _lock:
        for recorder in _recorders:
            recorder.made.add(id(tensor))


def guard(read: Callable[[], Any], value: Any) -> None:
    """The calling thread's recording (if any) depends on the Python value ``read()``,
    now ``value`` (a module's ``training`` flag): a replay checks it first, and records
    again where it changed."""
    found = current()
    if found is not None:
        found.value_guards.append((read, value))


def derived(fn: Callable[..., np.ndarray], sources: tuple[Any, ...], result: np.ndarray) -> None:
    """``Recorder.derive`` on the calling thread's recording, if one is in progress."""
    found = current()
    if found is not None:
        found.derive(fn, sources, result)


def _has_slot(spec: Any) -> bool:
    if spec[0] == "slot":
        return True
    return spec[0] == "tuple" and any(_has_slot(s) for s in spec[1])


def depends(value: Any) -> bool:
    """Whether ``value`` is a tensor or a value of the calling thread's recording (so
    something made from it changes from call to call)."""
    found = current()
    return found is not None and (isinstance(value, _tensor[0])
                                  or id(value) in found.array_slot)


def fail(reason: str) -> None:
    """What the calling thread's recording cannot replay happened (no-op without one)."""
    recorder = current()
    if recorder is not None:
        recorder.fail(reason)
