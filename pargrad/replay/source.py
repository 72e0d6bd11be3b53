"""Generated Python for replays: names for the values the code reads, and compiling it.

A replay runs first by interpreting its plans (no compile: a recording costs little
more than the eager call); after ``COMPILE_AFTER`` replays its plans become one Python
function each (forward, and the backward of each segment), where every call is a line
on local variables: the interpreter's list indexing and loop are gone. Compiling costs
about 10 microseconds per generated line here, which is why it waits for a step that
is replayed.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

COMPILE_AFTER = 2
"""Replays of a recording interpreted before its code is generated and compiled."""


class Namespace:
    """The values generated code reads from outside (kernels, rules, constants):
    ``name(value)`` gives an identifier bound to ``value`` (the same one each time)."""

    def __init__(self) -> None:
        self.values: dict[str, Any] = {}
        self._count = itertools.count()
        self._known: dict[int, str] = {}

    def name(self, value: Any, hint: str = "c") -> str:
        key = id(value)
        found = self._known.get(key)
        if found is not None:
            return found
        name = f"{hint}{next(self._count)}"
        self.values[name] = value
        self._known[key] = name
        return name


def compile_function(lines: list[str], namespace: Namespace, name: str) -> Callable[..., Any]:
    """The function ``name`` that ``lines`` define, reading ``namespace``'s names."""
    env = dict(namespace.values)
    exec(compile("\n".join(lines), f"<pargrad.capture {name}>", "exec"), env)
    fn: Callable[..., Any] = env[name]
    return fn


def call(callee: str, args: Sequence[str], params: dict[str, Any], ns: Namespace,
         pspec: dict[str, Any] | None = None, prefix: str = "v") -> str:
    """The source of a call; a parameter that holds values of the recording
    (``Instr.pspec``) reads them from the variables named ``prefix`` + slot."""
    words = list(args)
    for k, v in params.items():
        if pspec is not None and k in pspec:
            words.append(f"{k}={expression(pspec[k], ns, prefix)}")
        else:
            words.append(f"{k}={ns.name(v, 'p')}")
    return f"{callee}({', '.join(words)})"


def expression(spec: Any, ns: Namespace, prefix: str) -> str:
    """The source of an operand spec (``("slot", n)``, ``("value", v)``, ``("tuple",
    specs)``)."""
    if spec[0] == "slot":
        return f"{prefix}{spec[1]}"
    if spec[0] == "tuple":
        return tuple_of([expression(s, ns, prefix) for s in spec[1]])
    return ns.name(spec[1])


def tuple_of(items: Sequence[str]) -> str:
    return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"


def params_source(params: dict[str, Any], ns: Namespace, pspec: dict[str, Any] | None,
                  prefix: str) -> str:
    """The source of the dict ``params``, as ``call`` writes each parameter."""
    if pspec is None:
        return ns.name(params, "p")
    return "{" + ", ".join(f"{k!r}: {expression(pspec[k], ns, prefix)}" if k in pspec
                           else f"{k!r}: {ns.name(v, 'p')}" for k, v in params.items()) + "}"


def resolve_params(params: dict[str, Any], pspec: dict[str, Any] | None,
                   values: Sequence[Any]) -> dict[str, Any]:
    """``params`` with the values of the recording ``pspec`` names read from ``values``
    (the interpreter's)."""
    if pspec is None:
        return params
    return {k: resolve(pspec[k], values) if k in pspec else v for k, v in params.items()}


def resolve(spec: Any, values: Sequence[Any]) -> Any:
    """The value of an operand spec, slots read from ``values`` (the interpreter's)."""
    if spec[0] == "slot":
        return values[spec[1]]
    if spec[0] == "tuple":
        return tuple(resolve(s, values) for s in spec[1])
    return spec[1]
