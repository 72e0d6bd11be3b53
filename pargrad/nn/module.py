"""Module: the base class of layers and models, in the shape of PyTorch's ``nn.Module``.

A Module holds Parameters, buffers (state that is not a parameter) and submodules. They
are registered by assigning them as attributes (``self.fc = Linear(4, 8)``) and found
again by name, in the order they were registered (``fc.weight``, ``layers.1.bias``).
Calling a module calls its ``forward``.

Thread-safety: registration, ``train``/``eval``, ``zero_grad`` and ``load_state_dict``
change the module and must not race with anything else on it; calling the module from
several threads at once is as safe as its ``forward`` (the layers of ``pargrad.nn`` only
read their parameters).

>>> import pargrad
>>> from pargrad import nn
>>> class Net(nn.Module):
...     def __init__(self):
...         super().__init__()
...         self.hidden = nn.Linear(3, 4)
...         self.out = nn.Linear(4, 2)
...     def forward(self, x):
...         return self.out(pargrad.relu(self.hidden(x)))
>>> net = Net()
>>> [name for name, _ in net.named_parameters()]
['hidden.weight', 'hidden.bias', 'out.weight', 'out.bias']
>>> net(pargrad.ones((5, 3))).shape
(5, 2)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple, TypeVar

import numpy as np

from pargrad.autograd import reset_grad
from pargrad.grad_mode import no_grad
from pargrad.nn.parameter import Parameter
from pargrad.tensor import Tensor

_STORES = ("_parameters", "_buffers", "_modules")
M = TypeVar("M", bound="Module")


class IncompatibleKeys(NamedTuple):
    """What ``load_state_dict`` found: the module's keys the state lacked, and the
    state's keys the module does not have."""

    missing_keys: list[str]
    unexpected_keys: list[str]


def _forward_unimplemented(self: Module, *args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError(f"{type(self).__name__} has no forward(); a Module subclass "
                              "defines forward() to say what calling it computes")


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


class Module:
    """The base class of layers and models: subclass it, call ``super().__init__()``
    first, assign Parameters and Modules as attributes, and define ``forward``.

    Attributes:
        training: True in training mode (the default), False after ``eval()``; some
            layers (``Dropout``) behave differently in the two.
    """

    training: bool
    _parameters: dict[str, Parameter | None]
    _buffers: dict[str, Tensor | None]
    _non_persistent: set[str]  # names of buffers left out of state_dict
    _modules: dict[str, Module | None]

    # An attribute rather than a method, so that subclasses define forward with their
    # own signature (mypy checks a method override against the base's).
    forward: Callable[..., Any] = _forward_unimplemented

    def __init__(self) -> None:
        # Straight into __dict__: __setattr__ looks for these stores.
        for name, value in (("training", True), ("_parameters", {}), ("_buffers", {}),
                            ("_non_persistent", set()), ("_modules", {})):
            object.__setattr__(self, name, value)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    # ----- registration -----
    def register_parameter(self, name: str, param: Parameter | None) -> None:
        """Add ``param`` (a Parameter, or None for a slot without one) as ``name``.

        Raises TypeError for another kind of value, KeyError for a name that is taken
        by another attribute, has a dot or is empty.
        """
        self._check_name(name, "_parameters")
        if param is not None and not isinstance(param, Parameter):
            raise TypeError(f"register_parameter: {name!r} must be a pargrad.nn.Parameter or "
                            f"None, got {type(param).__name__}; wrap a Tensor in Parameter()")
        self._parameters[name] = param

    def register_buffer(self, name: str, tensor: Any, persistent: bool = True) -> None:
        """Add ``tensor`` as the buffer ``name``: state that belongs to the module but is
        not a parameter (no optimizer updates it), saved in ``state_dict`` unless
        ``persistent=False``. An array is copied into a Tensor; None leaves the slot
        empty. Assigning to ``name`` later replaces the buffer.

        >>> import pargrad
        >>> m = pargrad.nn.Module()
        >>> m.register_buffer("steps", pargrad.zeros(()))
        >>> list(m.state_dict()), list(m.parameters())
        (['steps'], [])
        """
        self._check_name(name, "_buffers")
        self._buffers[name] = _as_buffer(name, tensor)
        if persistent:
            self._non_persistent.discard(name)
        else:
            self._non_persistent.add(name)

    def add_module(self, name: str, module: Module | None) -> None:
        """Add ``module`` as the submodule ``name`` (what ``self.name = module`` does)."""
        self._check_name(name, "_modules")
        if module is not None and not isinstance(module, Module):
            raise TypeError(f"add_module: {name!r} must be a Module or None, got "
                            f"{type(module).__name__}")
        self._modules[name] = module

    register_module = add_module

    def _check_name(self, name: str, store: str) -> None:
        if "_parameters" not in self.__dict__:
            raise AttributeError(f"{type(self).__name__}: call super().__init__() in __init__ "
                                 "before assigning parameters, buffers or submodules")
        if not isinstance(name, str):
            raise TypeError(f"a {store[1:-1]} name must be a str, got {type(name).__name__}")
        if not name or "." in name:
            raise KeyError(f"{name!r} is not a valid {store[1:-1]} name: it must be "
                           "non-empty and have no dot (dots join the names of nested modules)")
        if name not in getattr(self, store) and (
                name in self.__dict__ or hasattr(type(self), name)
                or any(name in getattr(self, other) for other in _STORES if other != store)):
            raise KeyError(f"{type(self).__name__} already has an attribute {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, (Parameter, Module)):
            store = "_parameters" if isinstance(value, Parameter) else "_modules"
            if "_parameters" in self.__dict__:  # else the registration says to call __init__
                self._forget(name, keep=store)  # rebinding keeps the name's place
            if isinstance(value, Parameter):
                self.register_parameter(name, value)
            else:
                self.add_module(name, value)
            return
        for store, kind in (("_parameters", "Parameter"), ("_modules", "Module")):
            items = self.__dict__.get(store)
            if items is not None and name in items:
                if value is not None:
                    raise TypeError(f"cannot assign a {type(value).__name__} to {name!r}, "
                                    f"which is a {kind} of {type(self).__name__}: assign a "
                                    f"{kind} or None (or del it first)")
                items[name] = None
                return
        buffers = self.__dict__.get("_buffers")
        if buffers is not None and name in buffers:
            buffers[name] = _as_buffer(name, value)
            return
        object.__setattr__(self, name, value)

    def __getattr__(self, name: str) -> Any:
        # Only reached when normal lookup fails: the registered members live in the stores.
        # (self.__dict__, not self._parameters: a half-built copy has no stores yet.)
        for store in _STORES:
            items = self.__dict__.get(store)
            if items is not None and name in items:
                return items[name]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __delattr__(self, name: str) -> None:
        for store in _STORES:
            items = self.__dict__.get(store)
            if items is not None and name in items:
                del items[name]
                self._non_persistent.discard(name)
                return
        object.__delattr__(self, name)

    def _forget(self, name: str, keep: str) -> None:
        """Drop ``name`` from the instance dict and every store but ``keep`` (it is being
        rebound as a member of ``keep``)."""
        self.__dict__.pop(name, None)
        for store in _STORES:
            if store != keep:
                getattr(self, store).pop(name, None)
        self._non_persistent.discard(name)

    # ----- walking the tree -----
    def named_modules(self, prefix: str = "", remove_duplicate: bool = True
                      ) -> Iterator[tuple[str, Module]]:
        """This module and every submodule below it, depth first, each with its dotted
        name (this one's is ``prefix``); a module reachable twice comes once, under its
        first name, unless ``remove_duplicate=False``."""
        return self._walk(prefix, set() if remove_duplicate else None)

    def _walk(self, prefix: str, seen: set[int] | None) -> Iterator[tuple[str, Module]]:
        if seen is not None:
            if id(self) in seen:
                return
            seen.add(id(self))
        yield prefix, self
        for name, child in self._modules.items():
            if child is not None:
                yield from child._walk(_join(prefix, name), seen)

    def modules(self) -> Iterator[Module]:
        """``named_modules()`` without the names."""
        for _, module in self.named_modules():
            yield module

    def named_children(self) -> Iterator[tuple[str, Module]]:
        """The direct submodules with their names, each module once."""
        seen: set[int] = set()
        for name, child in self._modules.items():
            if child is not None and id(child) not in seen:
                seen.add(id(child))
                yield name, child

    def children(self) -> Iterator[Module]:
        """The direct submodules, each once."""
        for _, child in self.named_children():
            yield child

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[tuple[str, Parameter]]:
        """Every parameter with its dotted name (``0.weight``, ``layers.1.bias``): each
        module's own in registration order, then its submodules', depth first. A
        parameter shared by several modules comes once, under its first name (unless
        ``remove_duplicate=False``); ``recurse=False``: this module's own only."""
        return self._named_members("_parameters", prefix, recurse, remove_duplicate)

    def parameters(self, recurse: bool = True) -> Iterator[Parameter]:
        """``named_parameters()`` without the names: what an optimizer takes."""
        for _, param in self.named_parameters(recurse=recurse):
            yield param

    def named_buffers(self, prefix: str = "", recurse: bool = True,
                      remove_duplicate: bool = True) -> Iterator[tuple[str, Tensor]]:
        """Every buffer with its dotted name, ordered as ``named_parameters``."""
        return self._named_members("_buffers", prefix, recurse, remove_duplicate)

    def buffers(self, recurse: bool = True) -> Iterator[Tensor]:
        """``named_buffers()`` without the names."""
        for _, buffer in self.named_buffers(recurse=recurse):
            yield buffer

    def _named_members(self, store: str, prefix: str, recurse: bool,
                       remove_duplicate: bool) -> Iterator[tuple[str, Any]]:
        modules = (self.named_modules(prefix, remove_duplicate) if recurse
                   else iter([(prefix, self)]))
        seen: set[int] = set()
        for module_prefix, module in modules:
            for name, value in getattr(module, store).items():
                if value is None or (remove_duplicate and id(value) in seen):
                    continue
                seen.add(id(value))
                yield _join(module_prefix, name), value

    def apply(self: M, fn: Callable[[Module], object]) -> M:
        """Call ``fn`` on every submodule, then on this module (children first, as in
        PyTorch: an initializer sees the leaves before their parents); returns self."""
        for child in self.children():
            child.apply(fn)
        fn(self)
        return self

    # ----- modes and gradients -----
    def train(self: M, mode: bool = True) -> M:
        """Set training mode on this module and every submodule; returns self.

        >>> import pargrad
        >>> model = pargrad.nn.Sequential(pargrad.nn.Linear(2, 2), pargrad.nn.Dropout())
        >>> [m.training for m in model.eval().modules()]
        [False, False, False]
        """
        if not isinstance(mode, bool):
            raise TypeError(f"train: mode must be a bool, got {type(mode).__name__}")
        self.training = mode
        for child in self.children():
            child.train(mode)
        return self

    def eval(self: M) -> M:
        """``train(False)``: evaluation mode (``Dropout`` passes its input through)."""
        return self.train(False)

    def requires_grad_(self: M, requires_grad: bool = True) -> M:
        """Set ``requires_grad`` of every parameter (False freezes them); returns self."""
        for param in self.parameters():
            param.requires_grad_(requires_grad)
        return self

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset every parameter's ``.grad``: to None (the default), or, with
        ``set_to_none=False``, to zeros in place, as ``Optimizer.zero_grad`` and
        PyTorch do: the ``.grad`` stays the same Tensor, made a leaf that does not
        require grad (a gradient from ``create_graph=True`` is cut off from its graph
        with ``detach_()``), and zeroed."""
        for param in self.parameters():
            reset_grad(param, set_to_none)

    # ----- saving and loading -----
    def state_dict(self) -> dict[str, np.ndarray]:
        """The parameters and persistent buffers by dotted name, as copies of their
        arrays (PyTorch's share memory; a state saved here never changes under you).
        A parameter shared by several modules is saved under each of its names, as in
        PyTorch, so ``load_state_dict`` finds every key it expects.

        >>> import pargrad
        >>> m = pargrad.nn.Linear(2, 1)
        >>> {name: array.shape for name, array in m.state_dict().items()}
        {'weight': (1, 2), 'bias': (1,)}
        """
        return {name: value.data.copy() for name, value in self._named_state("")}

    def _named_state(self, prefix: str) -> Iterator[tuple[str, Tensor]]:
        for name, param in self._parameters.items():
            if param is not None:
                yield prefix + name, param
        for name, buffer in self._buffers.items():
            if buffer is not None and name not in self._non_persistent:
                yield prefix + name, buffer
        for name, child in self._modules.items():
            if child is not None:
                yield from child._named_state(f"{prefix}{name}.")

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True
                        ) -> IncompatibleKeys:
        """Copy ``state_dict``'s values (arrays or Tensors, cast to each target's dtype)
        into the parameters and buffers of the same names, in place under ``no_grad``
        (the objects stay the ones an optimizer holds; their version counters move).

        Raises RuntimeError, and writes nothing, if a value's shape differs from its
        target's, or (``strict=True``) if keys are missing or unexpected; with
        ``strict=False`` the keys that match are loaded and the others returned.

        >>> import pargrad
        >>> a, b = pargrad.nn.Linear(2, 1), pargrad.nn.Linear(2, 1)
        >>> b.load_state_dict({"weight": a.weight, "extra": [0.0]}, strict=False)
        IncompatibleKeys(missing_keys=['bias'], unexpected_keys=['extra'])
        >>> bool((b.weight == a.weight).all())
        True
        """
        targets = dict(self._named_state(""))
        missing = [key for key in targets if key not in state_dict]
        unexpected = [key for key in state_dict if key not in targets]
        values = {key: np.asarray(state_dict[key]) for key in targets if key in state_dict}
        problems = [f"{key}: the state has shape {value.shape}, the module "
                    f"{targets[key].shape}" for key, value in values.items()
                    if value.shape != targets[key].shape]
        if strict:
            problems[:0] = [f"missing keys: {', '.join(missing)}"] if missing else []
            problems += [f"unexpected keys: {', '.join(unexpected)}"] if unexpected else []
        if problems:
            raise RuntimeError(f"load_state_dict into {type(self).__name__}: nothing was "
                               "loaded:\n  " + "\n  ".join(problems))
        with no_grad():
            for key, value in values.items():
                targets[key][...] = value.astype(targets[key].dtype, copy=False)
        return IncompatibleKeys(missing, unexpected)

    # ----- printing -----
    def extra_repr(self) -> str:
        """What this module's ``repr`` shows between its parentheses (its settings, e.g.
        ``in_features=4, out_features=8, bias=True``); a subclass overrides it."""
        return ""

    def __repr__(self) -> str:
        extra = self.extra_repr()
        children = [f"({name}): {child!r}" for name, child in self._modules.items()]
        if not children and "\n" not in extra:
            return f"{type(self).__name__}({extra})"
        lines = ([extra] if extra else []) + children
        body = "\n".join(lines).replace("\n", "\n  ")  # a child's lines indented once more
        return f"{type(self).__name__}(\n  {body}\n)"


def _as_buffer(name: str, value: Any) -> Tensor | None:
    if value is None or isinstance(value, Tensor):
        return value
    if isinstance(value, np.ndarray):
        return Tensor(value)
    raise TypeError(f"buffer {name!r} must be a Tensor, a numpy array or None, got "
                    f"{type(value).__name__}")
