"""``Optimizer``: what every optimizer shares. Parameter groups with their options, the
state of each parameter, ``zero_grad``, ``step``, the state dict, and updates during
backward (``step_in_backward``, pargrad/optim/in_backward.py). A subclass gives its
default options, checks them (``_check``) and updates one parameter by one step
(``_update``), as PyTorch's implementation of that optimizer computes it.

Guarantees:
- ``step`` and the updates during backward call the same ``_update`` with the same
  gradient, so they give the same bits.
- ``state`` holds one dict per parameter, made when the parameter joins the optimizer.
  Only ``add_param_group`` and ``load_state_dict`` add or replace entries. ``_update``
  changes only the entry of the parameter it updates, so updates of different
  parameters can run at once on different threads (during backward) without a lock.
- ``state_dict()`` copies every array, and ``load_state_dict`` copies what it loads, so
  a run resumed from a state dict continues bit for bit as the saved run would have.

Assumptions: the groups, their options and their parameters are not changed while
``step`` or a backward with updates runs. A scheduler changes ``lr`` between steps.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from pargrad.autograd import reset_grad
from pargrad.grad_mode import enable_grad, no_grad
from pargrad.optim.in_backward import StepInBackward
from pargrad.tensor import Tensor

Group = dict[str, Any]
"""A parameter group: ``"params"`` (a list of Tensors) and the optimizer's options."""


class Optimizer:
    """The base of pargrad's optimizers (``SGD``, ``Adam``, ``AdamW``, ``RMSprop``).

    ``params`` is an iterable of leaf Tensors, or of dicts (parameter groups), each with
    ``"params"`` and any options that differ from the defaults. ``param_groups`` is the
    list of groups with every option filled in; ``state[p]`` is the dict of what the
    optimizer keeps for ``p`` (empty until its first update). Not thread-safe: call
    ``step``, ``zero_grad`` and the rest from one thread at a time (the updates that
    ``step_in_backward`` makes run on the backward's engine threads).

    Raises TypeError for params that are not Tensors or groups, ValueError for an empty
    list, a non-leaf tensor, a parameter listed twice (in one group or in two) and
    option values the algorithm does not allow.

    >>> import pargrad
    >>> from pargrad.optim import SGD
    >>> w = pargrad.tensor([1.0, 2.0], requires_grad=True)
    >>> b = pargrad.tensor(0.5, requires_grad=True)
    >>> opt = SGD([{"params": [w]}, {"params": [b], "lr": 0.5}], lr=0.1)
    >>> [group["lr"] for group in opt.param_groups]
    [0.1, 0.5]
    >>> (w * w).sum().backward(); b.backward()
    >>> opt.step(); opt.zero_grad()
    >>> w.data, b.data
    (array([0.8, 1.6]), array(0.))
    """

    def __init__(self, params: Iterable[Tensor] | Iterable[Group], defaults: Group) -> None:
        self.defaults = defaults
        self.param_groups: list[Group] = []
        self.state: dict[Tensor, dict[str, Any]] = {}
        # The live StepInBackward, or None. Written by step_in_backward and its remove(),
        # from the thread that owns the optimizer (see the class docstring).
        self._in_backward: StepInBackward | None = None
        name = type(self).__name__
        if isinstance(params, (Tensor, dict)):
            raise TypeError(f"{name}: params must be an iterable of Tensors or of parameter "
                            f"groups (dicts), got one {type(params).__name__}; put it in a "
                            f"list")
        groups: list[Any] = list(params)
        if not groups:
            raise ValueError(f"{name}: got an empty list of parameters to optimize")
        if not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        for group in groups:
            self.add_param_group(group)

    def add_param_group(self, param_group: Group) -> None:
        """Add a group of parameters, with its own options (the defaults fill the rest).

        Useful to train layers added later, or with another learning rate. Raises as
        the constructor does; the optimizer is unchanged then. If ``step_in_backward``
        is active, the new parameters are updated during backward too.

        >>> import pargrad
        >>> from pargrad.optim import Adam
        >>> opt = Adam([pargrad.zeros(2, requires_grad=True)])
        >>> opt.add_param_group({"params": pargrad.ones(3, requires_grad=True), "lr": 0.1})
        >>> [(len(g["params"]), g["lr"], g["betas"]) for g in opt.param_groups]
        [(1, 0.001, (0.9, 0.999)), (1, 0.1, (0.9, 0.999))]
        """
        name = type(self).__name__
        if not isinstance(param_group, dict):
            raise TypeError(f"{name}: a parameter group must be a dict, got "
                            f"{type(param_group).__name__}")
        if "params" not in param_group:
            raise ValueError(f"{name}: a parameter group needs a 'params' entry")
        params = _params(param_group["params"], name, self.state)
        group = {"params": params, **self.defaults,
                 **{k: v for k, v in param_group.items() if k != "params"}}
        self._check(group)
        if self._in_backward is not None:  # may raise (a parameter DataParallel averages)
            self._in_backward.add(group)
        self.param_groups.append(group)
        for p in params:
            self.state[p] = {}

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the ``.grad`` of every parameter: to None (the default, which frees the
        memory and makes the next ``step`` skip parameters that get no gradient), or to
        zeros, in place, as ``Module.zero_grad`` and PyTorch do: the ``.grad`` stays the
        same Tensor, made a leaf that does not require grad (one with a graph of its
        own, from ``create_graph=True``, is cut off from it with ``detach_()``), and
        zeroed.

        >>> import pargrad
        >>> from pargrad.optim import SGD
        >>> w = pargrad.tensor([1.0], requires_grad=True)
        >>> opt = SGD([w], lr=0.1)
        >>> (w * 3).sum().backward()
        >>> opt.zero_grad(set_to_none=False); w.grad
        tensor([0.], dtype=float64)
        >>> opt.zero_grad(); w.grad is None
        True
        """
        for group in self.param_groups:
            for p in group["params"]:
                reset_grad(p, set_to_none)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Update every parameter that has a ``.grad`` by one step of the algorithm, in
        place (its version counter moves on, as an in-place op's would).

        ``closure``, if given, is called first, with grad mode on, to compute the loss
        again (zero the gradients, forward, backward) and return it; ``step`` returns
        what it returned (else None). Blocks until done; runs on the calling thread.

        >>> import pargrad
        >>> from pargrad.optim import SGD
        >>> w = pargrad.tensor([3.0], requires_grad=True)
        >>> opt = SGD([w], lr=0.25)
        >>> def closure():
        ...     opt.zero_grad()
        ...     loss = (w * w).sum()
        ...     loss.backward()
        ...     return loss
        >>> opt.step(closure).item(), w.item()
        (9.0, 1.5)
        """
        loss = None
        if closure is not None:
            with enable_grad():
                loss = closure()
        with no_grad():
            for group in self.param_groups:
                for p in group["params"]:
                    grad = p.grad
                    if grad is not None:
                        self._update(p, grad.data, group, self.state[p])
        return loss

    def step_in_backward(self) -> StepInBackward:
        """Update each parameter during backward, as soon as its gradient is final.

        Registers on every parameter that requires grad a post-accumulate-grad hook
        that runs this optimizer's update of that parameter, on whichever thread
        completes its gradient, and then sets its ``.grad`` to None. Each backward then
        does what ``backward(); step(); zero_grad()`` does, bit for bit, on every engine;
        a backward that fails (or is cancelled) changes no parameter and no state
        (docs/training.md, "Updates during backward"). Returns a handle: ``remove()``
        (or leaving its ``with`` block) goes back to plain ``step``.

        Raises RuntimeError if a handle of this optimizer is active already, and if a
        parameter has a hook that takes its final gradient already: ``DataParallel``'s,
        which averages it across ranks only after the backward, so an update during
        backward would use this rank's own gradient (with DataParallel, call ``step()``
        after ``DataParallel.backward``). Nothing is registered then.

        >>> import pargrad
        >>> from pargrad.optim import SGD
        >>> w = pargrad.tensor([1.0, 2.0], requires_grad=True)
        >>> opt = SGD([w], lr=0.1)
        >>> with opt.step_in_backward():
        ...     (w * w).sum().backward()          # updates w, then frees its gradient
        >>> w.data, w.grad is None
        (array([0.8, 1.6]), True)
        """
        if self._in_backward is not None:
            raise RuntimeError(f"{type(self).__name__}.step_in_backward: this optimizer "
                               f"already updates during backward; remove() that handle "
                               f"first")
        self._in_backward = StepInBackward(self)
        return self._in_backward

    def _handle_removed(self, handle: StepInBackward) -> None:
        """``handle.remove()`` was called: updates happen in ``step`` again."""
        if self._in_backward is handle:
            self._in_backward = None

    def state_dict(self) -> dict[str, Any]:
        """What resumes this optimizer: ``{"state": ..., "param_groups": ...}``.

        As PyTorch's: parameters are numbered in the order of the groups and their
        ``"params"``; ``"state"`` maps a number to that parameter's state (parameters
        with none left out), ``"param_groups"`` lists each group's options with the
        numbers of its parameters. Arrays are numpy copies, so later steps do not change
        a state dict already taken; numbers are Python numbers. The parameters
        themselves are not in it.

        >>> import pargrad
        >>> from pargrad.optim import SGD
        >>> w = pargrad.tensor([1.0, 2.0], requires_grad=True)
        >>> opt = SGD([w], lr=0.1, momentum=0.9)
        >>> (w * w).sum().backward(); opt.step()
        >>> saved = opt.state_dict()
        >>> saved["state"]
        {0: {'momentum_buffer': array([2., 4.])}}
        >>> saved["param_groups"][0]["params"], saved["param_groups"][0]["momentum"]
        ([0], 0.9)
        """
        number: dict[Tensor, int] = {}
        groups = []
        for group in self.param_groups:
            ids = [number.setdefault(p, len(number)) for p in group["params"]]
            groups.append({**{k: _copied(v) for k, v in group.items() if k != "params"},
                           "params": ids})
        state = {number[p]: {k: _copied(v) for k, v in entry.items()}
                 for p, entry in self.state.items() if entry}
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Take the state and the group options of ``state_dict`` (from ``state_dict()``
        of an optimizer of the same kind over parameters of the same shapes, grouped the
        same way). The parameters stay this optimizer's own; arrays are copied, cast to
        each parameter's dtype (``step`` counts stay ints).

        Raises ValueError (the optimizer unchanged) if the groups or their sizes differ,
        if the state names a parameter that does not exist, or if an array's shape is
        not its parameter's.

        >>> import pargrad
        >>> from pargrad.optim import Adam
        >>> w = pargrad.tensor([1.0, -1.0], requires_grad=True)
        >>> opt = Adam([w], lr=0.1)
        >>> (w * w).sum().backward(); opt.step()
        >>> copy = pargrad.tensor(w.data, requires_grad=True)
        >>> resumed = Adam([copy], lr=0.5)
        >>> resumed.load_state_dict(opt.state_dict())
        >>> resumed.param_groups[0]["lr"], resumed.state[copy]["step"]
        (0.1, 1)
        """
        name = type(self).__name__
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(f"{name}.load_state_dict: the state dict has "
                             f"{len(saved_groups)} parameter groups, this optimizer "
                             f"{len(self.param_groups)}")
        by_number: dict[Any, Tensor] = {}
        groups = []
        for i, (saved, group) in enumerate(zip(saved_groups, self.param_groups)):
            if len(saved["params"]) != len(group["params"]):
                raise ValueError(f"{name}.load_state_dict: group {i} of the state dict has "
                                 f"{len(saved['params'])} parameters, this optimizer's "
                                 f"{len(group['params'])}")
            by_number.update(zip(saved["params"], group["params"]))
            loaded = {"params": group["params"],
                      **{k: _copied(v) for k, v in saved.items() if k != "params"}}
            self._check(loaded)
            groups.append(loaded)
        state: dict[Tensor, dict[str, Any]] = {p: {} for p in self.state}
        for number, entry in state_dict["state"].items():
            if number not in by_number:
                raise ValueError(f"{name}.load_state_dict: the state names parameter "
                                 f"{number!r}, which no group of the state dict lists")
            param = by_number[number]
            state[param] = {k: _loaded(v, param, k, name) for k, v in entry.items()}
        for group, loaded in zip(self.param_groups, groups):
            group.clear()  # the same dicts: a StepInBackward's hooks hold them
            group.update(loaded)
        self.state = state

    def __repr__(self) -> str:
        lines = [f"{type(self).__name__} ("]
        for i, group in enumerate(self.param_groups):
            options = ", ".join(f"{k}={v!r}" for k, v in group.items() if k != "params")
            lines.append(f"  group {i}: {len(group['params'])} parameters, {options}")
        return "\n".join([*lines, ")"])

    # ----- what a subclass gives -----

    def _check(self, group: Group) -> None:
        """Raise ValueError naming the option if ``group``'s options are not allowed."""

    def _update(self, param: Tensor, grad: np.ndarray, group: Group,
                state: dict[str, Any]) -> None:
        """One step of the algorithm for ``param``, whose gradient is ``grad``: change
        ``param`` in place (through pargrad's in-place ops: grad mode is off) and
        ``state`` (its entry). Touches nothing else, so that updates of different
        parameters may run at once."""
        raise NotImplementedError

    def _direction(self, param: Tensor, grad: np.ndarray, group: Group) -> np.ndarray:
        """The gradient a step follows: ``grad``, negated with ``maximize``, plus
        ``weight_decay * param`` (L2 decay, as SGD, Adam and RMSprop apply it). A new
        array where it differs from ``grad``, which is never written."""
        g = -grad if group["maximize"] else grad
        if group["weight_decay"] != 0:
            g = g + group["weight_decay"] * param.data
        return g


def _params(params: Any, name: str, known: dict[Tensor, dict[str, Any]]) -> list[Tensor]:
    """A group's ``"params"`` as a list, each checked: a leaf Tensor, listed once."""
    if isinstance(params, Tensor):
        params = [params]
    elif isinstance(params, (set, frozenset)):
        raise TypeError(f"{name}: a group's params must be an ordered collection (a list), "
                        f"not a set: the state dict refers to parameters by position")
    params = list(params)
    seen: set[Tensor] = set()  # (Tensors hash by identity)
    for i, p in enumerate(params):
        if not isinstance(p, Tensor):
            raise TypeError(f"{name}: params[{i}] is a {type(p).__name__}, not a Tensor")
        if not p.is_leaf:
            raise ValueError(f"{name}: params[{i}] is not a leaf (an op made it, it has a "
                             f"grad_fn): optimize the leaves it is computed from, or a "
                             f".detach() of it made to require grad")
        if p in seen or p in known:
            raise ValueError(f"{name}: params[{i}] is listed twice (in one parameter group, "
                             f"or in two): each parameter may appear once")
        seen.add(p)
    return params


def _copied(value: Any) -> Any:
    """A copy of a state or option value that later steps cannot change."""
    if isinstance(value, np.ndarray):
        return value.copy()
    if isinstance(value, list):
        return list(value)
    return value


def _loaded(value: Any, param: Tensor, key: str, name: str) -> Any:
    """A state value from a state dict, for ``param``: arrays copied to its dtype."""
    if not isinstance(value, np.ndarray):
        return value
    if value.shape != param.shape:
        raise ValueError(f"{name}.load_state_dict: state {key!r} has shape {value.shape}, "
                         f"but its parameter has shape {param.shape}")
    return np.array(value, dtype=param.dtype)


def check_non_negative(owner: str, group: Group, *names: str) -> None:
    """Raise ValueError unless each option ``names`` of ``group`` is a number >= 0."""
    for name in names:
        value = group[name]
        if not (isinstance(value, (int, float, np.number)) and value >= 0):
            raise ValueError(f"{owner}: {name} must be a number >= 0, got {value!r}")
