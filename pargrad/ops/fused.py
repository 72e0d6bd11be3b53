"""Fused kernels for the rules that dominate large backwards (optional: numba).

``pip install 'pargrad[fast]'`` brings numba; then the rules of tanh, sigmoid, relu,
softmax and log_softmax compute a float64 gradient of at least ``large.OUT_MIN``
elements in one pass of a compiled kernel instead of three to five passes of numpy
(measured in docs/performance.md, "Large arrays"). Without numba, turned off, or for
other dtypes, the rules take their numpy form.

Guarantees:
- Each kernel is ``kernel(out, *inputs)``: it writes into ``out`` (a fresh array the
  caller owns) and reads the inputs only, so it may run on any slice of them; the
  elementwise ones take one-dimensional arrays (flattened contiguous ones), softmax's
  and log_softmax's two-dimensional ones (rows along the last axis, whole rows per
  slice). They release the GIL (``nogil``), so on large arrays the elementwise ones run
  in chunks that idle engine threads help with, each chunk written in place
  (``parallel.for_chunks``).
- The elementwise kernels (tanh, sigmoid, relu) do the numpy form's arithmetic in its
  order: the same bits. Each has a ``_scalar`` twin, ``kernel(out, s, input)``, for a
  gradient that is a broadcast of the one value ``s`` (a ``sum``'s): the same
  arithmetic on the same numbers, reading one array instead of two. softmax and
  log_softmax sum each row in order (numpy sums pairwise) and use numba's ``exp``:
  within a few ulps of the numpy form, not the same bits. Every engine runs the same
  rule, so deterministic mode stays bitwise equal across engines *with the same kernel
  set*: compare runs with the kernels on, or both with them off.
- Compiled on first use (under ``_compile_lock``; each kernel again at its first call
  with new argument types), with numba's on-disk cache (``cache=True``), so later
  processes load them instead of compiling. Measured here: the first kernel call of a
  process still costs about 2 s (numba's import and start-up), the others about 10 ms.

Assumptions: numba's compiled functions may be called from any number of threads at
once (they hold no state).

Where numba is installed but fails to import (say, a release older than the installed
numpy), the first large rule warns once (RuntimeWarning) and the kernels stay off.

Turn them off with the environment variable ``PARGRAD_FUSED=0`` (read at import) or
``set_enabled(False)``, e.g. to compare with a machine that has no numba.
"""

from __future__ import annotations

import importlib.util
import os
import threading
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np

from pargrad import memory, parallel
from pargrad.ops import large
from pargrad.parallel import for_chunks

Kernel = Callable[..., None]

_available = importlib.util.find_spec("numba") is not None
_enabled = _available and os.environ.get("PARGRAD_FUSED", "1") != "0"

# Guards _kernels: one thread compiles each kernel; the rest wait and take it.
_compile_lock = threading.Lock()
_kernels: dict[str, Kernel] = {}


def available() -> bool:
    """Whether numba is installed (the kernels can be used)."""
    return _available


def enabled() -> bool:
    """Whether the rules use the fused kernels (numba installed and not turned off)."""
    return _enabled


def set_enabled(flag: bool) -> bool:
    """Turn the fused kernels on or off for every thread; returns the previous setting.

    Turning them on without numba installed raises ImportError. Thread-safe (one
    flag, read once per rule call); a rule already running finishes as it started.

    >>> from pargrad.ops import fused
    >>> previous = fused.set_enabled(False)
    >>> fused.enabled()
    False
    >>> _ = fused.set_enabled(previous)
    """
    global _enabled
    if flag and not _available:
        raise ImportError("pargrad's fused kernels need numba: pip install 'pargrad[fast]'")
    previous, _enabled = _enabled, bool(flag)
    return previous


def kernel(name: str) -> Kernel | None:
    """The compiled kernel ``name`` (``tanh_backward``, ``sigmoid_backward``,
    ``relu_backward``, their twins for a gradient of one value ``tanh_backward_scalar``,
    ``sigmoid_backward_scalar``, ``relu_backward_scalar``, and ``softmax_backward``,
    ``log_softmax_backward``), or None where the kernels are off. The first call in a
    process imports numba and makes them all (blocking; see the module's guarantees for
    what it costs)."""
    if not _enabled:
        return None
    found = _kernels.get(name)
    if found is None:
        with _compile_lock:
            if not _kernels:
                try:
                    _kernels.update(_compile())
                except ImportError as exc:  # installed but broken (e.g. too old for numpy)
                    _unavailable(exc)
                    return None
            found = _kernels[name]
    return found


def _unavailable(exc: ImportError) -> None:
    """Turn the kernels off for good after numba failed to import, and say so once."""
    global _available, _enabled
    _available = _enabled = False
    warnings.warn(f"pargrad's fused kernels are off: numba failed to import ({exc}); "
                  f"the rules use numpy (set PARGRAD_FUSED=0 to skip trying)",
                  RuntimeWarning, stacklevel=3)


STREAMING_MIN = parallel.STREAMING_MIN
"""Elements from which an elementwise kernel runs in chunks on idle threads: one pass
that streams memory gains little from a second core (1.15x at 4*10^6 elements, 0.7x at
6*10^5, docs/performance.md)."""


_F64 = np.dtype(np.float64)  # numpy's one native float64 dtype: `is` is its cheap test


def elementwise(name: str, g: np.ndarray, other: np.ndarray) -> np.ndarray | None:
    """``kernel(name)`` run on ``g`` and ``other`` (float64 arrays of one shape, ``other``
    contiguous) into a fresh array, or None where there is no kernel for them (off,
    another dtype, or a strided array: numpy's form handles those). A ``g`` that is a
    broadcast of one value (``large.uniform``: a ``sum``'s gradient) runs the kernel's
    ``_scalar`` twin with that value, which reads one array instead of two."""
    if (g.dtype is not _F64 or other.dtype is not _F64 or g.shape != other.shape
            or not other.flags.c_contiguous):
        return None
    if g.flags.c_contiguous:
        first: Any = g.reshape(-1)
        run = kernel(name)
    elif (first := large.uniform(g)) is not None:
        run = kernel(name + "_scalar")
    else:
        return None
    if run is None:
        return None
    out = memory.empty(g.shape)
    flat_out, flat_other = out.reshape(-1), other.reshape(-1)
    if out.size >= STREAMING_MIN:
        scalar = first.ndim == 0
        if for_chunks(out.size, lambda s: run(flat_out[s], first if scalar else first[s],
                                              flat_other[s]), STREAMING_MIN):
            return out
    run(flat_out, first, flat_other)  # small, or no idle thread: in one call
    return out


def rows(name: str, g: np.ndarray, ans: np.ndarray, axis: int) -> np.ndarray | None:
    """``kernel(name)`` run row by row (along ``axis``, which must be the last one, of
    contiguous float64 arrays) into a fresh array, or None where it cannot run."""
    if (axis != ans.ndim - 1 or g.dtype != np.float64 or ans.dtype != np.float64
            or g.shape != ans.shape or not g.flags.c_contiguous
            or not ans.flags.c_contiguous):
        return None
    run = kernel(name)
    if run is None:
        return None
    out = memory.empty(g.shape)
    width = g.shape[-1]
    run(out.reshape(-1, width), g.reshape(-1, width), ans.reshape(-1, width))
    return out


# The kernels' loops count as its branches; they are defined here so that numba is
# imported only once a kernel is first used.
def _compile() -> dict[str, Kernel]:  # noqa: C901
    """Every kernel, compiled (or loaded from numba's cache)."""
    from numba import njit

    # One-dimensional: the caller passes contiguous arrays (or slices of them) flattened.
    @njit(nogil=True, cache=True)
    def tanh_backward(out: Any, g: Any, y: Any) -> None:
        for i in range(out.size):
            out[i] = g[i] * (1.0 - y[i] * y[i])

    @njit(nogil=True, cache=True)
    def sigmoid_backward(out: Any, g: Any, y: Any) -> None:
        for i in range(out.size):
            out[i] = g[i] * (y[i] * (1.0 - y[i]))

    @njit(nogil=True, cache=True)
    def relu_backward(out: Any, g: Any, x: Any) -> None:
        for i in range(out.size):
            out[i] = g[i] * (1.0 if x[i] > 0 else 0.0)

    # The same with every g[i] the one value s (a broadcast gradient): the same bits.
    @njit(nogil=True, cache=True)
    def tanh_backward_scalar(out: Any, s: float, y: Any) -> None:
        for i in range(out.size):
            out[i] = s * (1.0 - y[i] * y[i])

    @njit(nogil=True, cache=True)
    def sigmoid_backward_scalar(out: Any, s: float, y: Any) -> None:
        for i in range(out.size):
            out[i] = s * (y[i] * (1.0 - y[i]))

    @njit(nogil=True, cache=True)
    def relu_backward_scalar(out: Any, s: float, x: Any) -> None:
        for i in range(out.size):
            out[i] = s * (1.0 if x[i] > 0 else 0.0)

    # Two-dimensional: rows along the last axis.
    @njit(nogil=True, cache=True)
    def softmax_backward(out: Any, g: Any, ans: Any) -> None:
        for i in range(g.shape[0]):
            total = 0.0
            for j in range(g.shape[1]):
                total += g[i, j] * ans[i, j]
            for j in range(g.shape[1]):
                out[i, j] = ans[i, j] * (g[i, j] - total)

    @njit(nogil=True, cache=True)
    def log_softmax_backward(out: Any, g: Any, ans: Any) -> None:
        for i in range(g.shape[0]):
            total = 0.0
            for j in range(g.shape[1]):
                total += g[i, j]
            for j in range(g.shape[1]):
                out[i, j] = g[i, j] - np.exp(ans[i, j]) * total

    return {"tanh_backward": tanh_backward, "sigmoid_backward": sigmoid_backward,
            "relu_backward": relu_backward, "softmax_backward": softmax_backward,
            "tanh_backward_scalar": tanh_backward_scalar,
            "sigmoid_backward_scalar": sigmoid_backward_scalar,
            "relu_backward_scalar": relu_backward_scalar,
            "log_softmax_backward": log_softmax_backward}
