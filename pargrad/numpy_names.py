"""Torch's keyword spellings, caught: ``x.sum(dim=0)`` raises a TypeError that says
pargrad uses numpy's names (``axis=``, ``keepdims=``), instead of Python's bare
"unexpected keyword argument".

Only a call that fails with TypeError is looked at, so a call that works costs one
Python call more (the wrapper's) and nothing else.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

# torch's keyword -> numpy's
TORCH_NAMES = {"dim": "axis", "keepdim": "keepdims"}


def numpy_names(function: F) -> F:
    """Wrap ``function`` so that a torch keyword among its arguments gets a TypeError
    naming numpy's keyword. ``inspect.signature`` and ``help`` still show
    ``function``'s own signature."""

    @functools.wraps(function)
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            return function(*args, **kwargs)
        except TypeError:
            refuse_torch_names(function.__name__, kwargs)
            raise

    return call  # type: ignore[return-value]


def refuse_torch_names(name: str, kwargs: dict[str, Any]) -> None:
    """Raise TypeError if ``kwargs`` uses a torch keyword that numpy spells differently."""
    used = [k for k in kwargs if k in TORCH_NAMES]
    if used:
        spelled = ", ".join(f"{k}= -> {TORCH_NAMES[k]}=" for k in used)
        raise TypeError(f"{name}: pargrad uses numpy's names: axis=, keepdims= ({spelled})"
                        ) from None
