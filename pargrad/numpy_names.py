"""Torch's keyword spellings, caught: ``x.sum(dim=0)`` raises a TypeError that says
pargrad uses numpy's names (``axis=``, ``keepdims=``), instead of Python's bare
"unexpected keyword argument".

``numpy_names(f)`` is a generated ``def`` with ``f``'s own parameters plus
``**unexpected``: a call that works costs one Python call more and nothing else (no
``*args`` repacking); a keyword that ``f`` does not take is refused there.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

# torch's keyword -> numpy's
TORCH_NAMES = {"dim": "axis", "keepdim": "keepdims"}


def numpy_names(function: F) -> F:
    """``function`` behind a ``def`` of the same parameters that refuses keywords it does
    not take, naming numpy's keyword for torch's. ``inspect.signature`` and ``help``
    show ``function``'s own signature (``__wrapped__``). Takes functions whose
    parameters are positional-or-keyword or keyword-only."""
    parameters = inspect.signature(function).parameters.values()
    namespace: dict[str, Any] = {"_function": function, "_refuse": refuse_unexpected}
    declared, passed = [], []
    for i, p in enumerate(parameters):
        if p.kind is p.KEYWORD_ONLY and "*" not in declared:
            declared.append("*")
        if p.kind not in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
            raise TypeError(f"numpy_names: {function.__name__} has a parameter {p}")
        if p.default is p.empty:
            declared.append(p.name)
        else:
            namespace[f"_default{i}"] = p.default
            declared.append(f"{p.name}=_default{i}")
        passed.append(p.name if p.kind is p.POSITIONAL_OR_KEYWORD else f"{p.name}={p.name}")
    name = function.__name__
    exec(f"def {name}({', '.join([*declared, '**unexpected'])}):\n"
         f"    if unexpected:\n"
         f"        _refuse({name!r}, unexpected)\n"
         f"    return _function({', '.join(passed)})\n", namespace)
    wrapper = namespace[name]
    for attribute in ("__module__", "__qualname__", "__doc__"):
        setattr(wrapper, attribute, getattr(function, attribute))
    wrapper.__wrapped__ = function
    return wrapper


def refuse_unexpected(name: str, unexpected: dict[str, Any]) -> None:
    """Raise TypeError for keywords ``name`` does not take; for torch's spellings, say
    that pargrad uses numpy's."""
    torch = [k for k in unexpected if k in TORCH_NAMES]
    if torch:
        spelled = ", ".join(f"{k}= -> {TORCH_NAMES[k]}=" for k in torch)
        raise TypeError(f"{name}: pargrad uses numpy's names: axis=, keepdims= ({spelled})")
    raise TypeError(f"{name}() got an unexpected keyword argument {next(iter(unexpected))!r}")
