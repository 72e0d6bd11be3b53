"""The test suite's random-DAG recipes (``tests/strategies.py``) built in PyTorch, op for op.

``GraphRecipe.build`` writes each step in pargrad; ``build`` below writes the same step
with the same PyTorch ops, in the same order, so that both libraries record the same
nodes: ``broadcast_to`` is ``torch.broadcast_to``, ``split`` into ``n`` columns is one
``torch.split`` node, and the recipe's custom Function ``Pair`` is a
``torch.autograd.Function`` with the same forward and backward. A step kind this module
does not know raises ValueError (the strategies grew a step: translate it here too).
Written for float64 recipes (the benchmark's): PyTorch does not promote a float32 tensor
by a 0-d float64 one, where numpy's rules may.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from benchmarks.workloads import Trial

_pairs: dict[int, Any] = {}  # id(torch) -> the Pair Function of that torch module


def _pair(torch: Any) -> Any:
    """``Pair`` of tests/strategies.py as a torch.autograd.Function: ``(sin x, x cos x)``."""
    if id(torch) not in _pairs:
        class Pair(torch.autograd.Function):
            @staticmethod
            def forward(ctx: Any, t: Any) -> tuple[Any, Any]:
                ctx.save_for_backward(t)
                return torch.sin(t), t * torch.cos(t)

            @staticmethod
            def backward(ctx: Any, g_sin: Any, g_xcos: Any) -> Any:
                (t,) = ctx.saved_tensors
                return g_sin * torch.cos(t) + g_xcos * (torch.cos(t) - t * torch.sin(t))

        _pairs[id(torch)] = Pair
    return _pairs[id(torch)]


def build(torch: Any, recipe: Any, leaves: list[Any]) -> list[Any]:
    """The roots of ``recipe`` (a ``GraphRecipe``) run on ``leaves`` (torch tensors)."""
    n, values = recipe.n, list(leaves)
    for step in recipe.steps:
        kind, a = step[0], values[step[1]]
        if kind == "tanh":
            out = torch.tanh(a)
        elif kind == "sin":
            out = torch.sin(a)
        elif kind == "sigmoid":
            out = torch.sigmoid(a)
        elif kind == "scale":
            out = a * step[2] + torch.tensor(step[2], dtype=torch.float64)
        elif kind == "square":
            out = a * a * 0.5
        elif kind in ("pair_first", "pair_second", "pair_both"):
            first, second = _pair(torch).apply(a)
            out = {"pair_first": first, "pair_second": second,
                   "pair_both": first * second}[kind]
        elif kind == "add":
            out = a + values[step[2]]
        elif kind == "sub":
            out = a - values[step[2]]
        elif kind == "mul":
            out = a * values[step[2]]
        elif kind == "matmul":
            out = (torch.broadcast_to(a, (n, n)) @ torch.broadcast_to(values[step[2]], (n, n))
                   ) * 0.5
        elif kind == "rowsum_add":
            out = torch.broadcast_to(a, (n, n)).sum(dim=1, keepdim=True) + values[step[2]]
        elif kind == "split_col_mul":
            columns = torch.split(torch.broadcast_to(a, (n, n)), 1, dim=1)
            out = columns[step[3]] * values[step[2]]
        else:
            raise ValueError(f"random-DAG step {kind!r} has no PyTorch translation in "
                             "benchmarks/torch_recipes.py: add one beside the others")
        values.append(out)
    return [values[r] for r in recipe.roots]


def trial(torch: Any, workload: Any, threads: int) -> Trial:
    """A ``RandomDag`` workload in PyTorch at ``threads`` intra-op threads: the same
    leaves (sharing their memory), the same root gradients, in one
    ``torch.autograd.backward``; returns every leaf's gradient as ``RandomDag`` does."""
    recipe = workload.recipe
    leaves = [torch.from_numpy(np.asarray(a)).requires_grad_(flag)
              for a, flag in zip(recipe.leaves, recipe.requires_grad)]
    grads = [torch.from_numpy(g) for g in workload.root_grads]

    def forward() -> list[Any]:
        for leaf in leaves:
            leaf.grad = None
        return build(torch, recipe, leaves)

    def backward(roots: list[Any]) -> np.ndarray:
        torch.autograd.backward(roots, grads)
        return np.concatenate([np.zeros(leaf.numel()) if leaf.grad is None
                               else leaf.grad.numpy().ravel() for leaf in leaves])
    return Trial(forward, backward, prepare=lambda: torch.set_num_threads(threads))


def count_nodes(torch: Any, roots: list[Any]) -> int:
    """The nodes a PyTorch backward from ``roots`` runs (leaf accumulators not counted)."""
    seen: set[Any] = set()
    stack = [t.grad_fn for t in roots if t.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        stack.extend(f for f, _ in node.next_functions if f is not None)
    return sum(type(node).__name__ != "AccumulateGrad" for node in seen)
