"""``pargrad.capture(fn)``: a step that records once and replays (docs/capture.md).

A ``Captured`` keeps a small cache of *variants*: one recording per guard key. The key
holds what the recording depends on and a call can change: the structure of the
arguments, each tensor argument's shape, dtype, device and requires_grad (and which
arguments are the same tensor), each numpy argument's shape and dtype (and whether it
is a tensor argument's own array), the value of every other argument (floats by their
bits; identity for unhashable ones, held weakly), grad mode, and the thresholds that
choose how large ops run. A variant's program checks the rest on each replay
(``Program.guard_failure``): the outside tensors the recording reached (shape, dtype,
device, requires_grad) and the Python values it was told to watch (a Dropout's
``training``); one that changed records the variant again.

Thread-safety: ``_lock`` guards the cache and ``stats``, ``_making`` the making of a
variant's program; recording and replaying run outside them, so several threads may
call one step at once (two that miss together both record; the later recording is
kept).
"""

from __future__ import annotations

import functools
import threading
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, ParamSpec, TypeVar

import numpy as np

from pargrad import anomaly, grad_mode, memory, parallel
from pargrad.graph import next_sequence_nr
from pargrad.ops import large as buffers
from pargrad.replay import program as programs
from pargrad.replay import recorder
from pargrad.replay.program import Program, Unreplayable
from pargrad.tensor import Tensor

P = ParamSpec("P")
R = TypeVar("R")

MAX_VARIANTS = 8
"""Variants a step keeps (as ``torch.compile``'s cache size limit); a step that needs
more runs eagerly from then on, with a warning."""


class CaptureWarning(UserWarning):
    """A captured function runs eagerly from now on (the message says why and where)."""


@dataclass
class CaptureStats:
    """What a captured step did so far (``step.stats``)."""

    calls: int = 0
    """Calls of the step."""
    replays: int = 0
    """Calls answered by replaying a recording."""
    records: int = 0
    """Calls that ran ``fn`` eagerly and recorded it (a first call, or a guard that failed)."""
    eager: int = 0
    """Calls that ran ``fn`` eagerly without recording (after a fallback, under anomaly
    mode, past ``MAX_VARIANTS``)."""
    reasons: list[str] = field(default_factory=list)
    """Why each recording happened, in order (``"first call"``, ``"argument 0: shape (32,
    64) -> (16, 64)"``, ...)."""
    fallback: str | None = None
    """Why the step runs eagerly for good (and the line that caused it), or None."""


class _Variant:
    """One recording of a step. Its program is made on its first replay (a step called
    once pays for recording only): until then ``pending`` holds the recording."""

    __slots__ = ("pending", "pinned", "program", "result")

    def __init__(self, program: Program | None,
                 pending: tuple[recorder.Recorder, list[recorder.Returned]] | None,
                 result: Any, pinned: list[Any]) -> None:
        self.program = program
        self.pending = pending
        self.result = result  # how to build fn's return value from the returned tensors
        # Arguments guarded by identity, held weakly where they can be (a variant whose
        # object dies is dropped, so that no new object with its id matches), else held.
        self.pinned = pinned


class Captured(Generic[P, R]):
    """``fn`` recorded on its first call and replayed after (``pargrad.capture``)."""

    def __init__(self, fn: Callable[P, R]) -> None:
        functools.update_wrapper(self, fn)
        self.fn = fn
        self.stats = CaptureStats()
        self._lock = threading.Lock()  # guards _variants and stats
        self._variants: dict[tuple[Any, ...], _Variant] = {}
        # Guards making a variant's program from its recording (once, by one thread).
        self._making = threading.Lock()

    def __repr__(self) -> str:
        return f"<pargrad.capture of {getattr(self.fn, '__qualname__', self.fn)!r}>"

    def __get__(self, instance: Any, owner: Any = None) -> Any:
        # As a decorator on a method: the bound method, captured per call with its self
        # as an argument (guarded by identity).
        if instance is None:
            return self
        return functools.partial(self.__call__, instance)

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        with self._lock:
            self.stats.calls += 1
            eager = self.stats.fallback is not None or (anomaly.on and anomaly.mode.enabled)
            if eager:
                self.stats.eager += 1
        if eager:
            return self.fn(*args, **kwargs)
        tensors: list[Tensor] = []
        arrays: list[np.ndarray] = []
        pinned: list[Any] = []
        key = (_flatten((args, kwargs), tensors, arrays, pinned),
               grad_mode.is_grad_enabled(), parallel.min_elements_, buffers.OUT_MIN,
               # which array arguments are a tensor argument's own array
               tuple(next((i for i, t in enumerate(tensors) if t.data is a), -1)
                     for a in arrays))
        with self._lock:
            variant = self._variants.get(key)
        if variant is not None:
            program = variant.program or self._program(variant)
            if program is None:  # it could not be made: this call runs eagerly
                return self.fn(*args, **kwargs)
            why = program.guard_failure()
            if why is None:
                out = program.run(tensors, arrays)
                with self._lock:
                    self.stats.replays += 1
                return _build(variant.result, out)
        else:
            with self._lock:
                known = list(self._variants)
            why = "first call" if not known else _difference(known, key)
        return self._record(args, kwargs, key, tensors, arrays, pinned, why)

    def _record(self, args: Any, kwargs: Any, key: tuple[Any, ...], tensors: list[Tensor],
                arrays: list[np.ndarray], pinned: list[Any], why: str) -> R:
        with self._lock:
            full = len(self._variants) >= MAX_VARIANTS and key not in self._variants
            if full:
                self.stats.eager += 1
        if full:
            self._fall_back(f"more than {MAX_VARIANTS} variants were recorded "
                            f"(the latest: {why})", None)
            return self.fn(*args, **kwargs)
        rec = recorder.Recorder(tensors, arrays, next_sequence_nr())
        recorder.start(rec)
        try:
            result = self.fn(*args, **kwargs)
            returned: list[Tensor] = []
            spec = _result_spec(result, returned, rec)
        finally:
            recorder.stop(rec)
        with self._lock:
            self.stats.records += 1
            self.stats.reasons.append(why)
        if rec.failure is None and _share_memory(returned):
            rec.fail("the function returns two tensors that share memory")
        if rec.failure is None and _views_an_input(returned, rec):
            rec.fail("the function returns a view of an argument or an outside tensor")
        if rec.failure is not None:
            self._fall_back(rec.failure, rec.where)
            return result
        kept = [recorder.Returned(rec, t) for t in returned]
        rec.finish()
        program = None
        if sum(i.node.cost for i in rec.instrs if i.node is not None) >= (
                programs.SEGMENT_COST):
            # Large arrays: making the program now costs little beside the kernels, and
            # the recording's arrays are not held until the next call.
            try:
                program = Program(rec, kept, self._fall_back)
            except Unreplayable as exc:
                self._fall_back(str(exc), None)
                return result
        variant = _Variant(program, None if program else (rec, kept), spec,
                           self._held(pinned, key))
        with self._lock:
            self._variants[key] = variant
        return result

    def _held(self, pinned: list[Any], key: tuple[Any, ...]) -> list[Any]:
        """Weak references to ``pinned`` (each dropping the variant of ``key`` when its
        object dies), or the objects themselves where they cannot be weakly referenced."""
        held: list[Any] = []
        for obj in pinned:
            try:
                held.append(weakref.ref(obj, functools.partial(self._forget, key)))
            except TypeError:
                held.append(obj)
        return held

    def _forget(self, key: tuple[Any, ...], _: Any = None) -> None:
        with self._lock:
            self._variants.pop(key, None)

    def _program(self, variant: _Variant) -> Program | None:
        """The program of ``variant``, made now from its recording (None: it cannot be
        replayed, and the step runs eagerly from now on)."""
        with self._making:
            pending = variant.pending
            if pending is None:  # another thread made it meanwhile
                return variant.program
            try:
                program = Program(*pending, self._fall_back)
            except Unreplayable as exc:
                self._fall_back(str(exc), None)
                with self._lock:
                    self.stats.eager += 1
                return None
            variant.program, variant.pending = program, None
            return program

    def _fall_back(self, reason: str, where: str | None) -> None:
        """Run ``fn`` eagerly from now on, saying why once."""
        with self._lock:
            if self.stats.fallback is not None:
                return
            self.stats.fallback = reason if where is None else f"{reason} (at {where})"
            self._variants.clear()
        message = (f"pargrad.capture: {getattr(self.fn, '__qualname__', self.fn)} runs "
                   f"eagerly from now on: {reason}")
        if where is not None:
            filename, _, line = where.rpartition(":")
            warnings.warn_explicit(message, CaptureWarning, filename, int(line))
        else:
            warnings.warn(message, CaptureWarning, stacklevel=4)


def capture(fn: Callable[P, R]) -> Captured[P, R]:
    """Record ``fn`` on its first call and replay it on later calls (docs/capture.md).

    The returned callable takes ``fn``'s arguments and returns what ``fn`` returns: the
    first call runs ``fn`` eagerly and records the ops it ran; a later call whose
    arguments (shapes, dtypes, devices, requires_grad, other values) and outside tensors
    fit a recording replays it, as straight-line kernel calls, and the tensors it
    returns backpropagate through the recorded backward. Answers are bit for bit those
    of calling ``fn``. Whatever a replay could get wrong (a value read back into Python,
    a hook registered or an in-place change inside ``fn``) makes the step run ``fn``
    eagerly from then on, with one ``CaptureWarning`` naming the line. ``step.stats``
    counts replays and recordings and says why each recording happened.

    >>> import pargrad
    >>> w = pargrad.tensor([1.0, 2.0], requires_grad=True)
    >>> step = pargrad.capture(lambda x: (pargrad.tanh(w * x)).sum())
    >>> for _ in range(3):
    ...     step(pargrad.tensor([0.5, 0.25])).backward()
    >>> step.stats.replays, step.stats.records
    (2, 1)
    >>> w.grad
    tensor([1.17...
    """
    return Captured(fn)


# ----- arguments -----

_SCALARS = (int, float, complex, bool, str, bytes, type(None), np.generic, np.dtype)
_SCALARS_TYPES = frozenset({int, float, complex, bool, str, bytes, type(None)})


def _flatten(value: Any, tensors: list[Tensor], arrays: list[np.ndarray],
             pinned: list[Any]) -> Any:
    """The guard key of ``value`` (an argument), collecting its tensors and arrays."""
    if isinstance(value, Tensor):
        same = next((i for i, t in enumerate(tensors) if t is value), -1)
        tensors.append(value)
        data = value.data
        return ("tensor", data.shape, data.dtype, value._device, value._requires_grad, same)
    if isinstance(value, np.ndarray):
        same = next((i for i, a in enumerate(arrays) if a is value), -1)
        arrays.append(value)
        return ("array", value.shape, value.dtype, same)
    if isinstance(value, (tuple, list)):
        return (type(value), tuple(_flatten(v, tensors, arrays, pinned) for v in value))
    if isinstance(value, dict):
        return (dict, tuple((k, _flatten(v, tensors, arrays, pinned)) for k, v in value.items()))
    if isinstance(value, (float, np.floating)):  # by its bits: 0.0 is not -0.0, nan is nan
        return ("float", type(value), float(value).hex())
    if isinstance(value, (complex, np.complexfloating)):
        return ("float", type(value), (complex(value).real.hex(), complex(value).imag.hex()))
    if isinstance(value, _SCALARS):
        return (type(value), value)
    pinned.append(value)
    return ("object", id(value))


def _difference(known: list[tuple[Any, ...]], new: tuple[Any, ...]) -> str:
    """Why ``new`` missed the cache, said against the nearest of the ``known`` keys."""
    old = min(known, key=lambda k: _count_differences(k, new))
    if old[1] != new[1]:
        return f"grad mode: {'enabled' if new[1] else 'disabled'}"
    if old[2:4] != new[2:4]:
        return "pargrad.parallel's or the pool's thresholds changed"
    if old[4] != new[4]:
        return "an array argument is (or no longer is) a tensor argument's array"
    (_, (old_args, old_kwargs)), (_, (new_args, new_kwargs)) = old[0], new[0]
    if len(old_args[1]) == len(new_args[1]):
        for i, (a, b) in enumerate(zip(old_args[1], new_args[1])):
            found = _first_difference(a, b, f"argument {i}")
            if found is not None:
                return found
    if [k for k, _ in old_kwargs[1]] == [k for k, _ in new_kwargs[1]]:
        for (name, a), (_, b) in zip(old_kwargs[1], new_kwargs[1]):
            found = _first_difference(a, b, f"argument {name}")
            if found is not None:
                return found
    return _first_difference(old[0], new[0], "arguments") or "new arguments"


def _float_of(key: tuple[Any, ...]) -> Any:
    """The number a ``("float", type, bits)`` key stands for."""
    bits = key[2]
    if isinstance(bits, tuple):
        return complex(float.fromhex(bits[0]), float.fromhex(bits[1]))
    return float.fromhex(bits)


def _count_differences(old: Any, new: Any) -> int:
    if old == new:
        return 0
    if isinstance(old, tuple) and isinstance(new, tuple) and len(old) == len(new):
        return sum(_count_differences(a, b) for a, b in zip(old, new))
    return 1


def _first_difference(old: Any, new: Any, where: str) -> str | None:
    if old == new:
        return None
    if isinstance(old, tuple) and isinstance(new, tuple) and old and new and (
            old[0] == new[0] and old[0] in ("tensor", "array")):
        names = ("shape", "dtype", "device", "requires_grad", "same tensor as")
        for name, a, b in zip(names, old[1:], new[1:]):
            if a != b:
                return f"{where}: {name} {a} -> {b}"
    if (isinstance(old, tuple) and isinstance(new, tuple) and len(old) == len(new) == 2
            and old[0] is new[0] and old[0] in _SCALARS_TYPES):
        return f"{where}: {old[1]!r} -> {new[1]!r}"
    if isinstance(old, tuple) and isinstance(new, tuple) and old[:1] == new[:1] == ("float",):
        return f"{where}: {_float_of(old)!r} -> {_float_of(new)!r}"
    if (isinstance(old, tuple) and isinstance(new, tuple) and len(old) == len(new) == 2
            and isinstance(old[1], tuple) and isinstance(new[1], tuple)
            and len(old[1]) == len(new[1])):
        for i, (a, b) in enumerate(zip(old[1], new[1])):
            found = _first_difference(a, b, f"{where}[{i}]")
            if found is not None:
                return found
    return f"{where}: {old!r} -> {new!r}"


# ----- the return value -----

def _views_an_input(returned: list[Tensor], rec: recorder.Recorder) -> bool:
    """Whether a tensor the recording made and ``fn`` returns shares memory with an
    argument or an outside tensor (eagerly a view of it, with its version counter)."""
    inputs = [rec.values[slot] for slot in rec.input_slots]
    return any(rec.slot.get(id(t)) not in rec.input_tensor and isinstance(a, np.ndarray)
               and np.may_share_memory(t.data, a) and np.shares_memory(t.data, a)
               for t in returned for a in inputs)


def _share_memory(tensors: list[Tensor]) -> bool:
    """Whether two of ``tensors`` share memory (only arrays in one owner's memory can)."""
    by_owner: dict[int, list[np.ndarray]] = {}
    for t in tensors:
        by_owner.setdefault(id(memory.owner(t.data)), []).append(t.data)
    return any(np.shares_memory(a, b) for arrays in by_owner.values()
               for i, a in enumerate(arrays) for b in arrays[i + 1:])


def _result_spec(value: Any, returned: list[Tensor], rec: recorder.Recorder,
                 seen: dict[int, int] | None = None) -> Any:
    """How to rebuild ``value`` (what ``fn`` returned) around replayed tensors."""
    seen = {} if seen is None else seen  # id(tensor) -> its index in returned
    if isinstance(value, Tensor):
        found = seen.get(id(value))
        if found is not None:
            return ("tensor", found)
        if id(value) not in rec.slot:
            rec.spec(value)  # an outside tensor returned as it is, or one made untraced
        seen[id(value)] = len(returned)
        returned.append(value)
        return ("tensor", len(returned) - 1)
    if isinstance(value, np.ndarray):
        rec.fail("the function returns a numpy array (return tensors: a replay cannot "
                 "tell where the array came from)")
        return ("value", value)
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a namedtuple
        return ("namedtuple", type(value), [_result_spec(v, returned, rec, seen) for v in value])
    if isinstance(value, (tuple, list)):
        return (type(value).__name__, type(value),
                [_result_spec(v, returned, rec, seen) for v in value])
    if isinstance(value, dict):
        return ("dict", type(value),
                [(k, _result_spec(v, returned, rec, seen)) for k, v in value.items()])
    if not isinstance(value, _SCALARS):
        rec.fail(f"the function returns a {type(value).__name__}, which capture does not "
                 f"look inside (return tensors, in tuples, lists or dicts)")
    return ("value", value)


def _build(spec: Any, out: list[Tensor]) -> Any:
    kind = spec[0]
    if kind == "tensor":
        return out[spec[1]]
    if kind == "value":
        return spec[1]
    if kind == "namedtuple":
        return spec[1](*[_build(s, out) for s in spec[2]])
    if kind == "dict":
        return spec[1]((k, _build(s, out)) for k, s in spec[2])
    return spec[1](_build(s, out) for s in spec[2])
