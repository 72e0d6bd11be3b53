"""viz: walking the graph and its DOT text (names, shapes, leaves, saved arrays, roots)."""

from __future__ import annotations

import re
import shutil
import subprocess
from typing import Any

import numpy as np
import pytest

import pargrad
from pargrad import Tensor
from pargrad.viz import nodes, to_dot

STATEMENT = re.compile(r'^  (\w+)( -> (\w+))?( \[.*\])?;$')


def parse(dot: str) -> tuple[dict[str, str], list[tuple[str, str, str]]]:
    """The labels of the declared ids and the edges ``(tail, head, label)`` of DOT text
    as to_dot writes it; fails on anything else, or on an edge to an undeclared id."""
    lines = dot.splitlines()
    assert lines[0] == 'digraph "backward" {' and lines[-1] == "}"
    assert lines[1].startswith("  node [")
    labels: dict[str, str] = {}
    edges: list[tuple[str, str, str]] = []
    for line in lines[2:-1]:
        match = STATEMENT.match(line)
        assert match, line
        found = re.search(r'label="((?:[^"\\]|\\.)*)"', match.group(4) or "")
        label = found.group(1).replace("\\n", "\n") if found else ""
        if match.group(3) is None:
            assert match.group(1) not in labels, f"{match.group(1)} declared twice"
            labels[match.group(1)] = label
        else:
            edges.append((match.group(1), match.group(3), label))
    for tail, head, _ in edges:
        assert tail in labels and head in labels, (tail, head)
    return labels, edges


def by_label(labels: dict[str, str], first_line: str) -> list[str]:
    return [i for i, text in labels.items() if text.split("\n")[0] == first_line]


def test_names_shapes_leaves_saved_arrays_and_several_roots() -> None:
    x = pargrad.tensor([1.0, 2.0, 3.0], requires_grad=True)
    w = pargrad.tensor(np.ones((3, 2), dtype=np.float32), requires_grad=True)
    h = (x.astype(np.float32) @ w).tanh()
    loss = h.sum()
    labels, edges = parse(to_dot(loss, h))
    assert labels["t0"] == "tensor 0\n() float32" and labels["t1"] == "tensor 1\n(2,) float32"
    (tanh,) = by_label(labels, "TanhBackward")
    (matmul,) = by_label(labels, "MatmulBackward")
    (summed,) = by_label(labels, "SumBackward")
    (cast,) = by_label(labels, "AstypeBackward")
    assert labels[tanh] == "TanhBackward\n(2,) float32"
    assert sorted(labels[i] for i in by_label(labels, "AccumulateGrad")) == [
        "AccumulateGrad\nleaf (3, 2) float32", "AccumulateGrad\nleaf (3,) float64"]
    arrows = {(a, b) for a, b, _ in edges}
    assert {("t0", summed), ("t1", tanh), (summed, tanh), (tanh, matmul),
            (matmul, cast)} <= arrows
    # What each node keeps, only what its rules read: tanh its output; matmul both
    # arguments; sum and astype nothing.
    saved = {(labels[a], labels[b].split("\n")[0], role) for a, b, role in edges
             if a.startswith("s")}
    assert saved == {
        ("saved\n(2,) float32", "TanhBackward", "output 0"),
        ("saved\n(3,) float32", "MatmulBackward", "arg 0"),
        ("saved: a leaf's data\n(3, 2) float32", "MatmulBackward", "arg 1"),
    }
    assert len([i for i in labels if i.startswith("s")]) == 3


def test_an_array_two_nodes_keep_is_one_note() -> None:
    x = pargrad.tensor([1.0, 2.0], requires_grad=True)
    w = pargrad.tensor([3.0, 4.0], requires_grad=True)
    h = x.tanh()  # tanh keeps its output; multiply keeps its arguments: h's array twice
    labels, edges = parse(to_dot((h * w).sum()))
    (tanh,) = by_label(labels, "TanhBackward")
    (mul,) = by_label(labels, "MultiplyBackward")
    kept = {(labels[b].split("\n")[0], role): a for a, b, role in edges if a.startswith("s")}
    assert kept[("TanhBackward", "output 0")] == kept[("MultiplyBackward", "arg 0")]
    assert kept[("MultiplyBackward", "arg 1")] != kept[("MultiplyBackward", "arg 0")]
    assert labels[tanh].startswith("TanhBackward") and labels[mul].startswith("MultiplyBackward")


def test_multi_output_nodes_label_outputs_and_edges() -> None:
    x = pargrad.tensor(np.arange(4.0), requires_grad=True)
    a, b = pargrad.split(x, [1])
    labels, edges = parse(to_dot(b, (a * 2).sum()))
    (split,) = by_label(labels, "SplitBackward")
    assert labels[split] == "SplitBackward\n0: (1,) float64\n1: (3,) float64"
    assert ("t0", split, "1") in edges
    (mul,) = by_label(labels, "MultiplyBackward")
    assert (mul, split, "0") in edges


def test_leaf_and_constant_roots_functions_and_devices() -> None:
    class Cube(pargrad.Function):
        @staticmethod
        def forward(ctx: Any, x: Tensor) -> np.ndarray:
            ctx.save_for_backward(x)
            return x.data ** 3

        @staticmethod
        def backward(ctx: Any, g: Tensor) -> Tensor:
            (x,) = ctx.saved_tensors
            return g * 3 * x ** 2

    x = pargrad.tensor([1.0, 2.0], requires_grad=True)
    y = Cube.apply(x.to("cpu:1"))
    labels, edges = parse(to_dot(y, x, pargrad.tensor(1.0)))
    assert labels["t1"] == "tensor 1 (leaf)\n(2,) float64"
    assert labels["t2"] == "tensor 2 (no grad)\n() float64"
    (cube,) = by_label(labels, "CubeBackward")
    assert labels[cube] == "CubeBackward\n(2,) float64\non cpu:1"
    (leaf,) = by_label(labels, "AccumulateGrad")
    assert ("t1", leaf, "") in edges  # a leaf root points at its accumulator
    assert any(a.startswith("s") and b == cube and role == "saved 0" for a, b, role in edges)
    with pytest.raises(TypeError, match="to_dot: argument 0 is a ndarray, not a Tensor"):
        to_dot(np.ones(2))  # type: ignore[arg-type]


def test_after_backward_freed_nodes_say_so(engine: pargrad.Engine) -> None:
    x = pargrad.tensor([0.5, 1.5], requires_grad=True)
    y = (x.exp() * 2).sum()
    y.backward()
    labels, edges = parse(to_dot(y))
    assert labels[by_label(labels, "ExpBackward")[0]].endswith("\n(saved values freed)")
    assert not labels[by_label(labels, "SumBackward")[0]].endswith("freed)")  # kept nothing
    assert not [a for a, _, _ in edges if a.startswith("s")]  # nothing saved any more


def test_graph_recorded_by_a_backward(engine: pargrad.Engine) -> None:
    x = pargrad.tensor([0.5, 1.5], requires_grad=True)
    (x.sin()).sum().backward(create_graph=True)
    names = [n.name() for n in nodes(x.grad)]
    assert names[0] == "CopyBackward" and "CosBackward" in names and "AccumulateGrad" in names
    parse(to_dot(x.grad))


def test_walks_deep_graphs_and_shared_nodes_once() -> None:
    x = pargrad.tensor(1.0, requires_grad=True)
    h = x
    for _ in range(20000):
        h = h * 1.0
    found = nodes(h, h * 2)
    assert len(found) == 20002 and len(set(found)) == 20002
    ops = [n.sequence_nr for n in found[:-1]]
    assert ops == sorted(ops, reverse=True)  # newest first, by creation
    assert isinstance(found[-1], pargrad.AccumulateGrad)  # x's, made by the first multiply


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz's dot is not installed")
def test_graphviz_renders_it(tmp_path: Any) -> None:
    x = pargrad.tensor([1.0, 2.0], requires_grad=True)
    a, b = pargrad.split(x * x, [1])
    path = tmp_path / "graph.dot"
    path.write_text(to_dot((a * b).sum(), b))
    result = subprocess.run(["dot", "-Tsvg", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "SplitBackward" in result.stdout
