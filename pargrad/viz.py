"""Seeing the backward graph: the nodes reachable from some tensors, as Graphviz DOT.

``to_dot(*tensors)`` draws what a backward from those tensors would run: one box per
node with its name and the shape and dtype of each output, arrows along
``next_functions`` (the way gradients flow), leaves (``AccumulateGrad``) and the roots
coloured, and the arrays each node keeps for its backward ("saved") as notes attached
to it by dashed lines; an array kept by several nodes is drawn once, and one that is a
leaf's own data (so costs no memory of its own) says so. Render the text with
Graphviz: ``dot -Tsvg graph.dot -o graph.svg``.

Only reads the graph, through ``Node.next_functions``, ``Node.name()``,
``Node.output_meta`` and what op and Function nodes save; a backward running meanwhile
may free saved arrays as it goes, and the picture then shows what was left when read.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pargrad.devices import CPU
from pargrad.function import FunctionNode
from pargrad.graph import ACCUMULATOR_PRIORITY, AccumulateGrad, Meta, Node, reachable
from pargrad.ops.core import OpNode
from pargrad.tensor import Tensor

ROOT_COLOR = "#c7e9c0"
LEAF_COLOR = "#c6dbef"
SAVED_COLOR = "#fdd0a2"


def nodes(*tensors: Tensor) -> list[Node]:
    """Every node a backward from ``tensors`` would reach, each once, newest first.

    Walks ``next_functions`` (``graph.reachable``) from each tensor's ``grad_fn`` (or,
    for a leaf that requires grad, its ``AccumulateGrad`` if a graph holds one), so it
    works on graphs of any depth.

    >>> import pargrad
    >>> x = pargrad.tensor([1.0, 2.0], requires_grad=True)
    >>> [n.name() for n in pargrad.viz.nodes((x * x).sum())]
    ['SumBackward', 'MultiplyBackward', 'AccumulateGrad']
    """
    roots = [n for n in (_root_node(t) for t in tensors) if n is not None]
    return sorted(reachable(roots), key=lambda n: -_created(n))


def _created(node: Node) -> int:
    """The node's place in creation order (an accumulator's ``sequence_nr`` is raised
    above every other node's: ``graph.ACCUMULATOR_PRIORITY``)."""
    if isinstance(node, AccumulateGrad):
        return node.sequence_nr - ACCUMULATOR_PRIORITY
    return node.sequence_nr


def to_dot(*tensors: Tensor, name: str = "backward") -> str:
    """The backward graph of ``tensors`` (one or more roots) as Graphviz DOT text.

    Raises TypeError if an argument is not a Tensor.

    >>> import pargrad
    >>> x = pargrad.tensor([1.0, 2.0], requires_grad=True)
    >>> print(pargrad.viz.to_dot((x * x).sum()), end="")  # doctest: +ELLIPSIS
    digraph "backward" {
    ...
      n... [label="MultiplyBackward\\n(2,) float64"];
    ...
    }
    """
    for i, t in enumerate(tensors):
        if not isinstance(t, Tensor):
            raise TypeError(f"to_dot: argument {i} is a {type(t).__name__}, not a Tensor")
    lines = [f"digraph {_quote(name)} {{",
             '  node [shape=box, style="rounded,filled", fillcolor=white, '
             'fontname="Helvetica", fontsize=10];']
    for i, t in enumerate(tensors):
        lines.extend(_root_lines(i, t))
    found = nodes(*tensors)
    leaf_data = {id(n.variable.data) for n in found if isinstance(n, AccumulateGrad)}
    saved_ids: dict[int, str] = {}
    for node in found:
        lines.append(_node_line(node))
        for next_node, input_nr in node.next_functions:
            if next_node is not None:
                label = f" [label={_quote(str(input_nr))}]" if next_node.num_outputs > 1 else ""
                lines.append(f"  {_id(node)} -> {_id(next_node)}{label};")
        for role, array in _saved(node):
            box = saved_ids.get(id(array))
            if box is None:
                box = saved_ids[id(array)] = f"s{len(saved_ids)}"
                what = "saved: a leaf's data" if id(array) in leaf_data else "saved"
                text = f"{what}\n{_meta((array.shape, array.dtype))}"
                lines.append(f"  {box} [label={_quote(text)}, shape=note, "
                             f'fillcolor="{SAVED_COLOR}"];')
            lines.append(f"  {box} -> {_id(node)} [label={_quote(role)}, style=dashed, "
                         f"arrowhead=none, fontsize=8];")
    lines.append("}")
    return "\n".join(lines) + "\n"


def _root_node(t: Tensor) -> Node | None:
    if t.grad_fn is not None:
        return t.grad_fn
    accumulator = t._accumulator() if t._accumulator is not None else None
    return accumulator if t.requires_grad else None


def _root_lines(i: int, t: Tensor) -> list[str]:
    kind = "" if t.grad_fn is not None else " (leaf)" if t.requires_grad else " (no grad)"
    text = f"tensor {i}{kind}\n{_meta((t.shape, t.dtype))}"
    lines = [f"  t{i} [label={_quote(text)}, fillcolor=\"{ROOT_COLOR}\"];"]
    node = _root_node(t)
    if node is not None:
        label = f" [label={_quote(str(t.output_nr))}]" if node.num_outputs > 1 else ""
        lines.append(f"  t{i} -> {_id(node)}{label};")
    return lines


def _node_line(node: Node) -> str:
    if isinstance(node, AccumulateGrad):
        text = f"AccumulateGrad\nleaf {_meta((node.variable.shape, node.variable.dtype))}"
        color = LEAF_COLOR
    else:
        metas = node.output_meta
        outputs = ([_meta(metas[0])] if len(metas) == 1
                   else [f"{k}: {_meta(m)}" for k, m in enumerate(metas)])
        text = "\n".join([node.name(), *outputs])
        color = "white"
    if node.device is not CPU:
        text += f"\non {node.device}"
    if node._released:
        text += "\n(saved values freed)"
    fill = f', fillcolor="{color}"' if color != "white" else ""
    return f"  {_id(node)} [label={_quote(text)}{fill}];"


def _saved(node: Node) -> list[tuple[str, np.ndarray]]:
    """``(role, array)`` for each array ``node`` keeps for its backward."""
    found: list[tuple[str, Any]] = []
    if isinstance(node, OpNode):
        if node.op.needs_values:  # shape-only ops keep shapes, not arrays
            found += [(f"arg {k}", a) for k, a in enumerate(node.saved_arrays or ())]
            found += [(f"output {k}", a) for k, a in enumerate(node.saved_outputs or ())]
    elif isinstance(node, FunctionNode):
        saved = node.saved.tensors or ()
        found += [(f"saved {k}", t.data if isinstance(t, Tensor) else t)
                  for k, t in enumerate(saved)]
    return [(role, a) for role, a in found if isinstance(a, np.ndarray)]


def _id(node: Node) -> str:
    return f"n{node.sequence_nr}"


def _meta(meta: Meta) -> str:
    shape, dtype = meta
    return f"{tuple(shape)} {dtype}"


def _quote(text: str) -> str:
    escaped = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{escaped}"'
