"""Containers of modules: ``Sequential`` (a chain, called in order) and ``ModuleList`` (a
list whose modules are registered, so their parameters are found). Both are indexed like
lists; their submodules are named ``0``, ``1``, ... (so ``0.weight``). As in PyTorch, a
slice of a ``Sequential`` keeps its modules' names (``model[1:]`` of three modules holds
``1`` and ``2``), and a slice of a ``ModuleList`` numbers them from ``0`` again.

>>> import pargrad
>>> from pargrad import nn
>>> model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
>>> len(model), type(model[-1]).__name__
(3, 'Linear')
>>> [name for name, _ in model.named_parameters()]
['0.weight', '0.bias', '2.weight', '2.bias']
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, TypeVar, overload

from pargrad.nn.module import Module

C = TypeVar("C", bound="_Indexed")


class _Indexed(Module):
    """Modules held in order (named ``"0"``, ``"1"``, ... unless given other names),
    indexed by position as a list is."""

    def _key(self, index: int) -> str:
        """The name of the module at ``index`` (negative counts from the end)."""
        keys = list(self._modules)
        if not -len(keys) <= index < len(keys):
            raise IndexError(f"{type(self).__name__} index {index} is out of range for "
                             f"{len(keys)} modules")
        return keys[index]

    def _at(self, index: int) -> Module:
        """The module at ``index`` (what ``self[index]`` returns)."""
        return self._modules[self._key(index)]  # type: ignore[return-value]

    def _items(self, index: slice) -> list[tuple[str, Module]]:
        """The names and modules of a slice, in order (a None entry left out)."""
        return [(name, m) for name, m in list(self._modules.items())[index] if m is not None]

    def __setitem__(self, index: int, module: Module) -> None:
        self.add_module(self._key(index), module)

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self) -> Iterator[Module]:
        return iter(m for m in self._modules.values() if m is not None)

    def append(self: C, module: Module) -> C:
        """Add ``module`` at the end, named by its position (or, in a slice that kept
        other names, the next number free); returns self."""
        number = len(self)
        while str(number) in self._modules:
            number += 1
        self.add_module(str(number), module)
        return self

    def extend(self: C, modules: Iterable[Module]) -> C:
        """Append each of ``modules``; returns self."""
        for module in modules:
            self.append(module)
        return self


class Sequential(_Indexed):
    """``Sequential(m0, m1, ...)``: calling it calls ``m0``, then ``m1`` on the result,
    and so on. Indexing (``model[0]``; ``model[1:]``, a new Sequential of those modules
    under the names they have here, as in PyTorch), ``len``, iteration and ``append``
    work as on a list. ``Sequential(OrderedDict(name=module, ...))`` names the modules
    instead.

    >>> import pargrad
    >>> from pargrad import nn
    >>> nn.Sequential(nn.Linear(4, 8), nn.Tanh())
    Sequential(
      (0): Linear(in_features=4, out_features=8, bias=True)
      (1): Tanh()
    )
    """

    def __init__(self, *modules: Module | Mapping[str, Module]) -> None:
        super().__init__()
        if len(modules) == 1 and isinstance(modules[0], Mapping):
            for name, module in modules[0].items():
                self.add_module(name, module)
        else:
            self.extend(modules)  # type: ignore[arg-type]

    @overload
    def __getitem__(self, index: int) -> Module: ...

    @overload
    def __getitem__(self, index: slice) -> Sequential: ...

    def __getitem__(self, index: int | slice) -> Module:
        if isinstance(index, slice):  # a plain Sequential even from a subclass, whose
            return Sequential(OrderedDict(self._items(index)))  # constructor may differ
        return self._at(index)

    def forward(self, x: Any) -> Any:
        for module in self:
            x = module(x)
        return x


class ModuleList(_Indexed):
    """A list of modules, registered so that ``parameters()``, ``train()`` and
    ``state_dict()`` see them (a plain Python list of modules hides them). It has no
    ``forward``: the module holding it decides how to call them.

    >>> import pargrad
    >>> from pargrad import nn
    >>> layers = nn.ModuleList([nn.Linear(2, 2) for _ in range(3)])
    >>> len(list(layers.parameters()))
    6
    """

    def __init__(self, modules: Iterable[Module] | None = None) -> None:
        super().__init__()
        self.extend(modules or ())

    @overload
    def __getitem__(self, index: int) -> Module: ...

    @overload
    def __getitem__(self, index: slice) -> ModuleList: ...

    def __getitem__(self, index: int | slice) -> Module:
        if isinstance(index, slice):  # numbered from 0 again, as PyTorch's (a plain
            return ModuleList(m for _, m in self._items(index))  # ModuleList: see above)
        return self._at(index)
