"""The backward of a replayed step: ``Segment`` (its plan, interpreted or compiled) and
``CapturedBackward``, the node a replay hands the engines for it.

The recorded nodes run newest first (the reference engine's order: it runs nodes in
decreasing sequence number, docs/design.md §2). Each node's rules are called as
``OpNode.apply``'s lean path calls them (the general path, ``Node.apply``'s, for nodes
of several outputs or variadic rules, and for gradients that are not arrays); every
gradient that two nodes send to one tensor is added in the canonical order (newest
sender first, then by edge) by ``engine.buffer.accumulate``, exactly as the engines add
it. So a replay gives the bits that the eager step gives on the reference engine and on
every engine in deterministic mode.

A segment is a ``CapturedBackward`` node in the engine's graph, with one output per
tensor the step returns (and per tensor a newer segment reads) and one edge per gradient
it sends out: to an argument or an outside tensor (a weight), or to an older segment.
Each gradient leaves on an edge of its own, in canonical order, so where a weight also
gets gradients from outside the step the engine adds them in the eager order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from pargrad import anomaly, grad_mode, parallel
from pargrad.devices import Device
from pargrad.engine.buffer import _sum as new_array_sum
from pargrad.engine.buffer import accumulate
from pargrad.graph import BackwardError, Grad, Meta, Node, _with_zeros, next_sequence_nr
from pargrad.replay import source
from pargrad.replay.source import Namespace, resolve, tuple_of
from pargrad.shapes import sum_to
from pargrad.versions import SavedVersion, check, counter_of

Dest = tuple[str, int]
"""Where a node's gradient for one edge goes: ``("var", v)``, the gradient variable
``v`` of the segment, or ``("out", e)``, the segment's edge ``e``."""


class NodeShape(Node):
    """What a plan keeps of a recorded node: its name, parameters and metadata, and
    which of its edges lead anywhere, for the checks of ``Node._check``; not its saved
    values nor the nodes it led to (the recording's graph is not kept alive)."""

    __slots__ = ("_name", "params")

    _name: str
    params: dict[str, Any]

    def name(self) -> str:
        return self._name


_EDGE = object()
"""What a ``NodeShape`` has in place of a next node (``_check`` asks only whether
there is one)."""


def shape_of(node: Any) -> NodeShape:
    shape = NodeShape.__new__(NodeShape)
    shape._name = node.name()
    shape.params = node.params
    shape.next_nodes = tuple(None if n is None else _EDGE for n in node.next_nodes)  # type: ignore[misc]
    shape.input_nrs = node.input_nrs
    shape._input_meta = node._input_meta
    shape._output_meta = node._output_meta
    shape.cost = node.cost
    shape.device = node.device
    shape.sequence_nr = node.sequence_nr
    shape._released = False
    shape._hooks = None
    shape._forward_trace = None
    return shape


class NodePlan:
    """One recorded node, as its segment's backward runs it."""

    def __init__(self, node: Any, op: Any, gin: tuple[int | None, ...],
                 args: tuple[Any, ...], ans: Any, pspec: dict[str, Any] | None,
                 dests: list[tuple[int, Dest]], check_index: int | None) -> None:
        self.node = shape_of(node)  # the recorded node's metadata, for its checks
        self.blas: bool = node.calls_blas
        self.name: str = node.name()
        self.op = op
        self.gin = gin  # per output: its gradient variable (None: it gets none)
        self.args = args  # per argument: the spec of what its rules read
        self.ans = ans  # the spec of the output they read (a tuple: several outputs)
        self.params = node.params
        self.saves = op.needs_values  # whether it saved values (freed after a backward)
        self.pspec = pspec  # parameters that hold values of the recording, as specs
        self.dests = dests  # per live edge: (edge index, destination)
        self.check = check_index  # its version checks in the node's ``versions``
        self.lean = op.direct_rules is not None and len(gin) == 1
        self.chunk = {i: ("cut" if i in op.cut_rules else "stream")
                      for i, _ in dests if i in op.cut_rules or i in op.stream_rules}

    def apply(self, grads: list[Grad | None], saved: Sequence[Any]) -> list[Grad | None]:
        """The gradient per edge (the interpreter's path; the compiled one is inline)."""
        args = tuple([resolve(a, saved) for a in self.args])
        ans = (None if self.ans is None else tuple(resolve(a, saved) for a in self.ans)
               if isinstance(self.ans, list) else resolve(self.ans, saved))
        params = source.resolve_params(self.params, self.pspec, saved)
        g = grads[0]
        if not self.lean or type(g) is not np.ndarray:
            return general(self.node, self.op)(grads, ans, args, params)
        out: list[Grad | None] = [None] * len(self.node.next_nodes)
        rules = self.op.direct_rules
        for i, _ in self.dests:
            r = None
            how = self.chunk.get(i)
            if how is not None and g.size >= parallel.min_elements_:
                r = parallel.elementwise(rules[i], (g, ans, *args), params,
                                         streaming=how == "stream")
            if r is None:
                r = rules[i](g, ans, *args, **params)
            meta = self.node._input_meta[i]
            assert meta is not None  # an edge that leads somewhere has its input's
            if type(r) is not np.ndarray or r.dtype is not meta[1] or r.shape != meta[0]:
                r = fitter(self.node, i)(r)
            out[i] = r
        return out


def fitter(node: Any, i: int) -> Callable[[Any], Any]:
    """What a replay does with a rule's result that is not an array of its input's shape
    and dtype object: what ``OpNode.apply`` does (sum a broadcast back, else check)."""
    shape, dtype = node._input_meta[i]

    def fit(r: Any) -> Any:
        if type(r) is np.ndarray and r.dtype == dtype:
            if r.shape == shape:
                return r
            summed = sum_to(r, shape)
            if summed is not None:
                return summed
        results: list[Any] = [None] * len(node.next_nodes)
        results[i] = r
        return node._check(results)[i]
    return fit


def general(node: Any, op: Any) -> Callable[..., list[Grad | None]]:
    """A node's backward by ``Node.apply``'s general path: outputs that got no gradient
    as zeros, every rule through ``Op.vjp``, every result checked."""
    def run(grads: list[Grad | None], ans: Any, args: tuple[Any, ...],
            params: dict[str, Any]) -> list[Grad | None]:
        full = _with_zeros(grads, node._output_meta)
        g = full if op.multi_output else full[0]
        outs = [None if n is None else op.vjp(i, g, ans, args, params)
                for i, n in enumerate(node.next_nodes)]
        return node._check(outs)
    return run


class Segment:
    """The backward of one segment of a recording: its node plans, run by ``interpret``
    until ``compile`` made them one generated function, and how to make its node."""

    def __init__(self, plans: list[NodePlan], incoming: list[int], n_vars: int,
                 accumulated: set[int], edges: list[tuple[str, Any]],
                 edge_meta: list[Meta | None], output_meta: tuple[Meta, ...],
                 saved_slots: list[int], checks: list[Any], device: Device) -> None:
        self.plans = plans
        self.incoming = incoming  # per output of the segment: its gradient variable
        self.n_vars = n_vars
        self.accumulated = accumulated  # variables that more than one gradient reaches
        self.edges = edges  # per edge out: ("ext", i), ("arg", i) or ("segment", (s, j))
        self.edge_meta = tuple(edge_meta)
        self.output_meta = output_meta
        self.saved_slots = saved_slots  # the slots of the values its rules read, in order
        # Per plan with checks: ([(where, "ext"|"arg", i)], [(where, returned index)]).
        self.checks = checks
        self.device = device
        self.calls_blas = any(p.blas for p in plans)
        self.cost = sum(p.node.cost for p in plans)
        self.names = [p.name for p in plans]
        self.needs_values = any(p.op.needs_values for p in plans)
        self.saving = [pos for pos, p in enumerate(plans) if p.saves]
        self.display_name = "CapturedBackward"
        # The node an eager second backward would find freed first: the newest that saved
        # values (the ones before it keep none and run again).
        self.first_saving = next((p.name for p in plans if p.op.needs_values),
                                 "CapturedBackward")
        self.run: Callable[..., list[Grad | None]] = self.interpret
        self.externals: list[Any] = []  # set by the program: its outside tensors
        self.give_up: Callable[[str, str | None], None] | None = None

    # ----- the interpreter -----

    # Run for every node of a replay before its compile: kept in one frame.
    def interpret(self, grads: list[Grad | None], saved: tuple[Any, ...],  # noqa: C901, PLR0912
                  versions: list[tuple[SavedVersion, ...]], ran: bytearray,
                  retain: bool) -> list[Grad | None]:
        g: list[Grad | None] = [None] * self.n_vars
        owned = [False] * self.n_vars
        for j, v in enumerate(self.incoming):
            g[v] = grads[j]
        out: list[Grad | None] = [None] * len(self.edges)
        plan = self.plans[0]
        try:
            for pos, plan in enumerate(self.plans):
                inputs = [None if v is None else g[v] for v in plan.gin]
                if all(x is None for x in inputs):
                    continue
                if plan.saves:
                    if ran[pos]:
                        released(plan.name)
                    if not retain:
                        ran[pos] = 1
                if plan.check is not None:
                    check(plan.name, versions[plan.check])
                results = plan.apply(inputs, saved)
                del inputs
                for dead in plan.gin:  # its gradients are dead now, as in the engines
                    if dead is not None:
                        g[dead] = None
                for i, (kind, where) in plan.dests:
                    r = results[i]
                    if kind == "out":
                        out[where] = r
                    elif r is not None:
                        total = g[where]
                        if total is None:
                            g[where] = r
                        else:
                            g[where], owned[where] = accumulate(total, owned[where], r)
        except BackwardError:
            raise
        except Exception as exc:
            raise BackwardError(plan.name, f"{type(exc).__name__}: {exc}") from exc
        return out

    # ----- the generated function -----

    def compile(self) -> None:
        """Make the plans one generated function and run that from now on."""
        ns = Namespace()
        lines = ["def backward(G, S, V, RAN, retain):"]
        lines += [f"    s{p} = S[{p}]" for p in range(len(self.saved_slots))]
        lines += [f"    g{v} = G[{j}]" for j, v in enumerate(self.incoming)]
        incoming = set(self.incoming)
        lines += [f"    g{v} = None" for v in range(self.n_vars) if v not in incoming]
        lines += [f"    o{v} = False" for v in sorted(self.accumulated)]
        lines.append(f"    R = [None] * {len(self.edges)}")
        lines.append("    at = 0")
        lines.append("    try:")
        for pos, plan in enumerate(self.plans):
            lines += self._node_lines(pos, plan, ns)
        lines += ["    except BackwardError:",
                  "        raise",
                  "    except Exception as exc:",
                  f"        raise BackwardError({ns.name(self.names, 'names')}[at], "
                  "f'{type(exc).__name__}: {exc}') from exc",
                  "    return R"]
        ns.values["ndarray"] = np.ndarray
        ns.values["BackwardError"] = BackwardError
        self.run = source.compile_function(lines, ns, "backward")

    def _node_lines(self, pos: int, plan: NodePlan, ns: Namespace) -> list[str]:
        gnames = ["None" if v is None else f"g{v}" for v in plan.gin]
        args = [_expr(a, ns) for a in plan.args]
        ans = "None" if plan.ans is None else tuple_of([_expr(a, ns) for a in plan.ans]) if (
            isinstance(plan.ans, list)) else _expr(plan.ans, ns)
        params = source.params_source(plan.params, ns, plan.pspec, "s")
        live = " or ".join(f"{g} is not None" for g in gnames if g != "None") or "False"
        lines = [f"        if {live}:  # {plan.name}", f"            at = {pos}"]
        if plan.saves:
            lines.append(f"            if RAN[{pos}]: {ns.name(released, 'released')}"
                         f"({plan.name!r})")
            lines.append(f"            if not retain: RAN[{pos}] = 1")
        if plan.check is not None:
            lines.append(f"            {ns.name(check, 'check')}({plan.name!r}, V[{plan.check}])")
        general_call = (f"{ns.name(general(plan.node, plan.op), 'general')}("
                        f"[{', '.join(gnames)}], {ans}, "
                        f"{tuple_of(args)}, {params})")
        if plan.lean:
            g = gnames[0]
            lines.append(f"            if type({g}) is ndarray:")
            rules = plan.op.direct_rules
            for i, _ in plan.dests:
                rule = ns.name(rules[i], "rule")
                call = source.call(rule, [g, ans, *args], plan.params, ns, plan.pspec, "s")
                how = plan.chunk.get(i)
                if how is not None:
                    lines.append(f"                r{i} = {ns.name(parallel.elementwise, 'ew')}("
                                 f"{rule}, {tuple_of([g, ans, *args])}, {params}, "
                                 f"streaming={how == 'stream'}) if {g}.size >= "
                                 f"{ns.name(parallel, 'par')}.min_elements_ else None")
                    lines.append(f"                if r{i} is None: r{i} = {call}")
                else:
                    lines.append(f"                r{i} = {call}")
                meta = plan.node._input_meta[i]
                assert meta is not None  # an edge that leads somewhere has its input's
                shape, dtype = meta
                lines.append(f"                if type(r{i}) is not ndarray or r{i}.dtype is not "
                             f"{ns.name(dtype, 'dt')} or r{i}.shape != {shape!r}: "
                             f"r{i} = {ns.name(fitter(plan.node, i), 'fit')}(r{i})")
            lines.append("            else:")
            lines.append(f"                rs = {general_call}")
            lines += [f"                r{i} = rs[{i}]" for i, _ in plan.dests]
        else:
            lines.append(f"            rs = {general_call}")
            lines += [f"            r{i} = rs[{i}]" for i, _ in plan.dests]
        # Its gradients are dead now (as the engines drop a buffer once its node ran).
        lines += [f"            g{v} = None" for v in plan.gin if v is not None]
        return lines + self._deliver_lines(plan, ns)

    def _deliver_lines(self, plan: NodePlan, ns: Namespace) -> list[str]:
        """The lines that hand a node's gradients on: to a variable of the segment (added
        up where several reach it) or to an edge out."""
        lines: list[str] = []
        add, new_sum = ns.name(np.add, "add"), ns.name(new_array_sum, "new_sum")
        for i, (kind, where) in plan.dests:
            g, owned = f"g{where}", f"o{where}"
            if kind == "out":
                lines.append(f"            R[{where}] = r{i}")
            elif where in self.accumulated:
                # engine.buffer.accumulate written out: every gradient here is an array
                # (a rule's result, checked), so the first is kept, the second summed into
                # a new array, and the later ones added into that one.
                lines += [f"            if r{i} is not None:",
                          f"                if {g} is None: {g} = r{i}",
                          f"                elif {owned}: {add}({g}, r{i}, {g})",
                          f"                else: {g}, {owned} = {new_sum}({g}, r{i}), True"]
            else:
                lines.append(f"            {g} = r{i}")
        return lines

    # ----- a replay's node -----

    def node(self, kept: tuple[Any, ...], kept_index: dict[int, int], ext_edges: list[Any],
             arg_tensors: list[Any], older: list[CapturedBackward]) -> CapturedBackward:
        """This segment's node for one replay (the older segments' nodes made first)."""
        nodes: list[Node | None] = []
        nrs: list[int] = []
        for kind, target in self.edges:
            if kind == "ext":
                node, nr = ext_edges[target]
            elif kind == "arg":
                node, nr = arg_tensors[target]._edge()
            else:
                s, j = target
                node, nr = older[s], j
            nodes.append(node)
            nrs.append(nr)
        fn = CapturedBackward.__new__(CapturedBackward)
        fn.next_nodes = tuple(nodes)
        fn.input_nrs = tuple(nrs)
        fn._input_meta = self.edge_meta
        fn._output_meta = self.output_meta
        fn.cost = self.cost
        fn._released = False
        fn.device = self.device
        fn.sequence_nr = next_sequence_nr()
        fn._hooks = None
        fn._forward_trace = None
        fn.segment = self
        fn.saved = tuple([kept[kept_index[slot]] for slot in self.saved_slots])
        versions: list[tuple[SavedVersion, ...]] = []
        for inputs_checked, _ in self.checks:
            records = []
            for where, kind, i in inputs_checked:
                t = self.externals[i] if kind == "ext" else arg_tensors[i]
                counter = counter_of(t)
                records.append(SavedVersion(where, counter, counter.value, t.data))
            versions.append(tuple(records))
        fn.versions = versions
        fn.ran = bytearray(len(self.plans))
        fn.retain = False
        return fn

    def watch_outputs(self, node: CapturedBackward, out: list[Any]) -> None:
        """Add the checks of the returned tensors whose memory this segment's nodes saved:
        each gets a version counter now, at version 0."""
        for c, (_, returned_checked) in enumerate(self.checks):
            if returned_checked:
                extra = []
                for where, r, like in returned_checked:
                    counter = counter_of(out[r])
                    extra.append(SavedVersion(where, counter, counter.value, like))
                node.versions[c] = node.versions[c] + tuple(extra)


def released(name: str) -> None:
    """Raise the error of a backward through a node whose saved values a backward
    without ``retain_graph`` freed (as ``Node.apply``'s)."""
    raise BackwardError(
        name, "trying to backward through the graph a second time, but its saved values "
              "were already freed; pass retain_graph=True to the first backward call")


def _expr(spec: Any, ns: Namespace) -> str:
    """A backward operand spec's source: ``("slot", p)`` is the saved value ``s{p}``."""
    return source.expression(spec, ns, "s")


class CapturedBackward(Node):
    """The backward of one segment of a replayed step: one output per tensor it hands on,
    one edge per gradient it sends out (pargrad/replay/backward.py).

    As each eager node frees its saved values after a backward without ``retain_graph``,
    each of its plans that saved values is marked in ``ran`` once it ran so; a later
    backward reaching it raises the eager error. The values go once every such plan ran.
    """

    __slots__ = ("ran", "retain", "saved", "segment", "versions")
    materialize_grads = False  # an output that got no gradient: its nodes do not run

    segment: Segment
    saved: tuple[Any, ...] | None
    versions: list[tuple[SavedVersion, ...]]
    ran: bytearray  # per plan: it ran in a backward that freed its values
    retain: bool  # the current backward's retain_graph

    def name(self) -> str:
        """The eager node's name where the segment hands on one tensor (the name in its
        errors, as eagerly); ``CapturedBackward`` otherwise."""
        return self.segment.display_name

    @property
    def calls_blas(self) -> bool:  # type: ignore[override]
        return self.segment.calls_blas

    def backward(self, grads: tuple[Grad, ...]) -> list[Grad | None]:
        segment = self.segment
        if grad_mode.is_grad_enabled():
            if segment.give_up is not None:
                segment.give_up("a backward with create_graph=True went through a replay",
                                None)
            raise BackwardError(
                segment.names[0],
                "create_graph=True through a step replayed by pargrad.capture is not "
                "supported; the step runs eagerly from its next call on")
        saved = self.saved
        if saved is None:  # every plan that saved values ran: any would raise
            released(segment.first_saving)
        return segment.run(list(grads), saved, self.versions, self.ran, self.retain)

    def apply(self, grads: Sequence[Grad | None], *, retain_graph: bool) -> list[Grad | None]:
        self.retain = retain_graph
        if (self._hooks is not None or (anomaly.on and anomaly.mode.enabled)
                or not grad_mode.off or grad_mode.mode.enabled):
            results = Node.apply(self, grads, retain_graph=retain_graph)
        else:
            for g in grads:
                if g is not None:
                    break
            else:
                return [None] * len(self.next_nodes)
            results = self.backward(tuple(grads))
        if not retain_graph and self.saved is not None and all(
                self.ran[pos] for pos in self.segment.saving):
            self.saved = None  # no plan will read them again
            self.versions = []
        return results

    def _free_saved(self) -> bool:
        return False  # per plan, by ``ran`` (``apply``)
