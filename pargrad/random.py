"""Random leaf Tensors from a seedable generator (numpy's ``np.random.Generator``).

``pargrad.random.seed(0)`` reseeds the default generator, which the module functions
(``normal``, ``uniform``, ``randn``, ``rand``, ``integers``) draw from; a ``Generator(seed)``
of your own gives a stream nobody else draws from. A seed gives the same values as
``np.random.default_rng(seed)`` drawing the same way. Thread-safe: each generator draws
under its own lock (numpy's generators are not safe to share between threads).

>>> import pargrad
>>> pargrad.random.seed(0)
>>> a = pargrad.random.randn(2, 3, requires_grad=True)
>>> pargrad.random.seed(0)
>>> bool((pargrad.random.randn(2, 3) == a).all())
True
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from pargrad.devices import CPU
from pargrad.devices import device as as_device
from pargrad.replay import recorder
from pargrad.tensor import Tensor


class Generator:
    """A stream of random numbers, seeded with ``seed`` (None: fresh entropy from the OS).

    Each method returns a new leaf Tensor and takes ``requires_grad`` and ``device`` as
    ``pargrad.tensor`` does; ``dtype`` (float64 by default) casts the float64 draws.
    """

    def __init__(self, seed: int | None = None) -> None:
        # Guards _rng: a numpy Generator's state is not safe to advance from two threads.
        self._lock = threading.Lock()
        self._rng = np.random.default_rng(seed)

    def seed(self, seed: int | None) -> None:
        """Restart the stream from ``seed``."""
        with self._lock:
            self._rng = np.random.default_rng(seed)

    def draw(self, draw: str, args: tuple[Any, ...], dtype: Any = None) -> np.ndarray:
        """The array of numpy's ``Generator.<draw>(*args)``, cast to ``dtype``."""
        with self._lock:
            array = np.asarray(getattr(self._rng, draw)(*args))
        if dtype is not None:
            array = array.astype(dtype, copy=False)
        return array

    def _leaf(self, draw: str, args: tuple[Any, ...], dtype: Any, requires_grad: bool,
              device: Any) -> Tensor:
        return drawn(lambda: self.draw(draw, args, dtype), device, requires_grad)

    def normal(self, loc: float = 0.0, scale: float = 1.0, size: Any = None,
               dtype: Any = np.float64, *, requires_grad: bool = False,
               device: Any = None) -> Tensor:
        """Samples of the normal distribution with mean ``loc`` and standard deviation
        ``scale``, of shape ``size`` (None: one value, a 0-d Tensor)."""
        return self._leaf("normal", (loc, scale, size), dtype, requires_grad, device)

    def uniform(self, low: float = 0.0, high: float = 1.0, size: Any = None,
                dtype: Any = np.float64, *, requires_grad: bool = False,
                device: Any = None) -> Tensor:
        """Samples uniform in ``[low, high)``, of shape ``size``."""
        return self._leaf("uniform", (low, high, size), dtype, requires_grad, device)

    def randn(self, *shape: int, dtype: Any = np.float64, requires_grad: bool = False,
              device: Any = None) -> Tensor:
        """Standard normal samples of the given shape (``randn(2, 3)`` or
        ``randn((2, 3))``, as torch's)."""
        return self.normal(0.0, 1.0, _shape(shape), dtype, requires_grad=requires_grad,
                           device=device)

    def rand(self, *shape: int, dtype: Any = np.float64, requires_grad: bool = False,
             device: Any = None) -> Tensor:
        """Samples uniform in ``[0, 1)`` of the given shape (``rand(2, 3)``)."""
        return self.uniform(0.0, 1.0, _shape(shape), dtype, requires_grad=requires_grad,
                            device=device)

    def integers(self, low: int, high: int | None = None, size: Any = None, *,
                 device: Any = None) -> Tensor:
        """Random int64 values in ``[low, high)`` (``[0, low)`` if ``high`` is None)."""
        return self._leaf("integers", (low, high, size), None, False, device)


def drawn(make: Callable[[], np.ndarray], device: Any = None,
          requires_grad: bool = False) -> Tensor:
    """A leaf Tensor of ``make()``'s array, ``make`` drawing random values: a function
    that ``pargrad.capture`` records calls ``make`` again on every replay, as calling the
    function would."""
    leaf = Tensor._make(make(), device=CPU if device is None else as_device(device))
    leaf.requires_grad_(requires_grad)
    if recorder.active and (found := recorder.current()) is not None:
        found.note_random(make, leaf)
    return leaf


def _shape(shape: tuple[Any, ...]) -> tuple[int, ...]:
    """``(2, 3)`` from ``randn(2, 3)`` and from ``randn((2, 3))``."""
    if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
        return tuple(shape[0])
    return shape


default_generator = Generator()
"""The generator the module functions draw from; ``seed`` reseeds it."""


def seed(seed: int | None) -> None:
    """Reseed the default generator (as ``torch.manual_seed`` / ``np.random.seed``)."""
    default_generator.seed(seed)


def normal(loc: float = 0.0, scale: float = 1.0, size: Any = None, dtype: Any = np.float64,
           *, requires_grad: bool = False, device: Any = None) -> Tensor:
    """``Generator.normal`` on the default generator."""
    return default_generator.normal(loc, scale, size, dtype, requires_grad=requires_grad,
                                    device=device)


def uniform(low: float = 0.0, high: float = 1.0, size: Any = None, dtype: Any = np.float64,
            *, requires_grad: bool = False, device: Any = None) -> Tensor:
    """``Generator.uniform`` on the default generator."""
    return default_generator.uniform(low, high, size, dtype, requires_grad=requires_grad,
                                     device=device)


def randn(*shape: int, dtype: Any = np.float64, requires_grad: bool = False,
          device: Any = None) -> Tensor:
    """``Generator.randn`` on the default generator."""
    return default_generator.randn(*shape, dtype=dtype, requires_grad=requires_grad,
                                   device=device)


def rand(*shape: int, dtype: Any = np.float64, requires_grad: bool = False,
         device: Any = None) -> Tensor:
    """``Generator.rand`` on the default generator."""
    return default_generator.rand(*shape, dtype=dtype, requires_grad=requires_grad,
                                  device=device)


def integers(low: int, high: int | None = None, size: Any = None, *,
             device: Any = None) -> Tensor:
    """``Generator.integers`` on the default generator."""
    return default_generator.integers(low, high, size, device=device)
