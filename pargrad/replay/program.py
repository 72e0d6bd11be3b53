"""A recording made into a program: ``Program`` replays a step's forward and hands the
engines ``CapturedBackward`` nodes for its backward (pargrad/replay/backward.py).

**Forward.** The recorded calls run again on the new arguments and the outside tensors'
current arrays, with no node, no version check and no dependency bookkeeping: ops call
their forward (as ``Op.call`` calls it: for large arrays from the pool or in chunks,
the same bits), random draws draw again, numpy functions of the operands run again,
constants are the recording's. First interpreted; after ``source.COMPILE_AFTER``
replays, one generated function (pargrad/replay/source.py).

**Segments.** The recorded nodes, in sequence order, are cut into runs, each a segment:
where the step returns a tensor that its own later ops read (so that the engine
completes that tensor's gradient, which its hooks, its ``retain_grad`` and
``grad(inputs=...)`` see, before the older segment runs), and where a run's nodes reach
``SEGMENT_COST`` elements (so that a ``ThreadedEngine`` runs independent segments of
large arrays at once). Runs of consecutive sequence numbers keep every sum in the
canonical order (pargrad/replay/backward.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from pargrad import memory, parallel
from pargrad.devices import CPU
from pargrad.ops import large as buffers
from pargrad.replay import source
from pargrad.replay.backward import CapturedBackward, NodePlan, Segment
from pargrad.replay.recorder import Instr, Recorder, Returned
from pargrad.replay.source import Namespace
from pargrad.tensor import Tensor

SEGMENT_COST = 1 << 18
"""The array elements a segment's nodes read and write (``Node.cost``, summed) from which
a new segment starts: a step of large arrays becomes several nodes in the engine's graph,
whose independent ones a ``ThreadedEngine`` runs at once, as it runs the eager nodes; a
step of small ones stays one node, its Python overhead paid once."""


class Unreplayable(Exception):
    """A recording that ``Program`` cannot make into a replay (the reason is the message)."""


def _kernel(op: Any, arrays: Sequence[Any], params: dict[str, Any],
            path: str) -> Callable[..., Any]:
    """What a replay calls for a recorded op: the call the eager op made of its forward,
    on these arrays' sizes (guarded, and the thresholds with them), by the path of
    ``Op.call`` that ran it: for large arrays, into an array of the pool or cut into
    chunks, with the same bits and the same memory layout as eagerly."""
    forward = op.forward
    if path == "outputs":  # Op.outputs calls the forward as it is
        return forward
    if path == "one":  # one Tensor, alone or beside a scalar: Op.call's first path
        size = arrays[0].size
        cut = op.cut_forward and size >= parallel.min_elements_
        big = cut or size >= buffers.OUT_MIN
    else:
        cut = op.cut_forward and parallel.large(arrays)
        big = cut or (op.ufunc and parallel.large(arrays, buffers.OUT_MIN))
    if not big:
        return forward
    pooled = op.ufunc and not params

    def large(*args: Any, **kw: Any) -> Any:
        out = parallel.elementwise(forward, args, kw) if cut else None
        if out is None:
            out = buffers.fresh(forward, *args) if pooled else forward(*args, **kw)
        return out
    return large


class _Step:
    """One recorded forward call, as the interpreter runs it."""

    __slots__ = ("fn", "form", "operands", "outs", "params", "pspec")

    def __init__(self, instr: Instr, fn: Callable[..., Any], form: str) -> None:
        self.fn = fn
        self.form = form  # "one", "raw" (wrap in an array), "multi", "random", "detach"
        self.operands = instr.operands
        self.params = instr.params
        self.pspec = instr.pspec
        self.outs = instr.outs

    def run(self, values: list[Any]) -> None:
        form = self.form
        if form == "random":
            values[self.outs[0]] = self.fn()
            return
        args = [values[s[1]] if s[0] == "slot" else s[1] for s in self.operands]
        if form == "detach":
            values[self.outs[0]] = args[0]
            return
        params = source.resolve_params(self.params, self.pspec, values)
        out = self.fn(*args, **params) if params else self.fn(*args)
        if form == "multi":
            for slot, o in zip(self.outs, out):
                values[slot] = np.asarray(o)
        else:
            values[self.outs[0]] = np.asarray(out) if form == "raw" else out


class Program:
    """One recorded variant of a step: made once per recording; ``run`` replays it."""

    def __init__(self, rec: Recorder, returned: list[Returned],
                 give_up: Callable[[str, str | None], None] | None = None) -> None:
        # Called with a reason when a replay meets what it cannot do (create_graph): the
        # step runs eagerly from then on.
        self.give_up = give_up
        self.n_slots = len(rec.values)
        self.input_slots = rec.input_slots
        self.const_slots = list(rec.const_slots.items())
        # The outside tensors with their guards: what a replay checks, reads and sends
        # gradients to.
        self.externals: list[Any] = []
        self.ext_guard: list[tuple[Any, ...]] = rec.guards  # as they were when recorded
        self.value_guards = rec.value_guards
        self.inputs: list[tuple[str, Any]] = []  # per input slot: ("arg"|"array"|"ext", i)
        self.ext_of_slot: dict[int, int] = {}
        for (kind, what), slot in zip(rec.inputs, rec.input_slots):
            if kind == "ext":
                self.ext_of_slot[slot] = len(self.externals)
                self.inputs.append(("ext", len(self.externals)))
                self.externals.append(what)
            else:
                self.inputs.append((kind, what))
        self.steps = [self._step(instr, rec) for instr in rec.instrs]
        kept: dict[int, int] = {}  # slot -> its index in what a forward keeps

        def keep(slot: int) -> int:
            return kept.setdefault(slot, len(kept))

        self.returned = self._returned(rec, returned, keep)
        self.segments, self.seg_output_index = _Analysis(rec, self, returned).segments(keep)
        for segment in self.segments:
            segment.externals = self.externals
            segment.give_up = give_up
        self.kept_slots = sorted(kept, key=kept.__getitem__)
        self.kept_index = {slot: n for n, slot in enumerate(self.kept_slots)}
        self.forward: Callable[..., tuple[Any, ...]] = self.interpret
        self.replays = 0
        for instr in rec.instrs:  # the recording's saved values are not needed any more
            instr.saved = (None, None, ())

    def _step(self, instr: Instr, rec: Recorder) -> _Step:
        if instr.kind == "op":
            arrays = [rec.values[s[1]] if s[0] == "slot" else s[1] for s in instr.operands]
            form = "multi" if instr.fn.multi_output else "raw" if instr.raw else "one"
            return _Step(instr, _kernel(instr.fn, arrays, instr.params, instr.path), form)
        if instr.kind == "call":
            return _Step(instr, instr.fn, "raw")
        return _Step(instr, instr.fn, instr.kind)  # random, detach

    def _returned(self, rec: Recorder, returned: list[Returned],
                  keep: Callable[[int], int]) -> list[tuple[str, Any]]:
        out: list[tuple[str, Any]] = []
        for t in returned:
            slot = t.slot
            if slot in self.ext_of_slot:
                out.append(("ext", self.externals[self.ext_of_slot[slot]]))
            elif slot in rec.input_slots:  # an argument itself
                out.append(("arg", rec.inputs[rec.input_slots.index(slot)][1]))
            else:
                keep(slot)
                kind = "const" if slot in rec.const_slots else (
                    "node" if t.grad_fn is not None else "plain")
                out.append((kind, (slot, t.device, t.grad_fn, t.output_nr)))
        return out

    # ----- forward -----

    def interpret(self, *inputs: Any) -> tuple[Any, ...]:
        values: list[Any] = [None] * self.n_slots
        for slot, value in zip(self.input_slots, inputs):
            values[slot] = value
        for slot, array in self.const_slots:
            values[slot] = array
        for step in self.steps:
            step.run(values)
        return tuple([values[slot] for slot in self.kept_slots])

    def compile(self) -> None:
        """Generate and compile the forward and every segment's backward."""
        ns = Namespace()
        lines = ["def forward(" + ", ".join(f"v{s}" for s in self.input_slots) + "):"]
        for slot, array in self.const_slots:
            lines.append(f"    v{slot} = {ns.name(array, 'k')}")
        for step in self.steps:
            out = f"v{step.outs[0]}"
            if step.form == "random":
                lines.append(f"    {out} = {ns.name(step.fn, 'r')}()")
                continue
            args = [f"v{s[1]}" if s[0] == "slot" else ns.name(s[1]) for s in step.operands]
            if step.form == "detach":
                lines.append(f"    {out} = {args[0]}")
                continue
            call = source.call(ns.name(step.fn, "f"), args, step.params, ns, step.pspec)
            if step.form == "multi":
                outs = ", ".join(f"v{o}" for o in step.outs)
                lines.append(f"    {outs}{',' if len(step.outs) == 1 else ''} = "
                             f"[asarray(o) for o in {call}]")
            elif step.form == "raw":
                lines.append(f"    {out} = asarray({call})")
            else:
                lines.append(f"    {out} = {call}")
        lines.append("    return " + source.tuple_of([f"v{s}" for s in self.kept_slots]))
        ns.values["asarray"] = np.asarray
        forward = source.compile_function(lines, ns, "forward")
        for segment in self.segments:
            segment.compile()
        self.forward = forward

    # ----- replay -----

    def guard_failure(self) -> str | None:
        """Why the recording no longer fits: an outside tensor or a watched Python value
        changed (None: everything fits)."""
        for t, guard in zip(self.externals, self.ext_guard):
            if _guard_of(t) != guard:
                return (f"an outside tensor changed: {_describe(guard)} -> "
                        f"{_describe(_guard_of(t))}")
        for read, value in self.value_guards:
            now = read()
            if now != value:
                return f"a value the function read changed: {value!r} -> {now!r}"
        return None

    def run(self, arg_tensors: list[Any], arg_arrays: list[Any]) -> list[Tensor]:
        """Replay: the returned tensors, in the order of the recording's."""
        self.replays += 1
        if self.replays == source.COMPILE_AFTER:
            self.compile()
        values = []
        for kind, i in self.inputs:
            if kind == "ext":
                values.append(self.externals[i].data)
            elif kind == "arg":
                values.append(arg_tensors[i].data)
            else:
                values.append(arg_arrays[i])
        kept = self.forward(*values)
        nodes: list[CapturedBackward] = []
        record = bool(self.segments)  # the recording's nodes (grad mode is guarded)
        if record:
            ext_edges = [t._edge() for t in self.externals]
            for segment in self.segments:  # oldest first: each may send to older ones
                nodes.append(segment.node(kept, self.kept_index, ext_edges, arg_tensors,
                                          nodes))
        out = self._outputs(kept, nodes, arg_tensors)
        for segment, node in zip(self.segments, nodes):
            segment.watch_outputs(node, out)
        return out

    def _outputs(self, kept: tuple[Any, ...], nodes: list[CapturedBackward],
                 arg_tensors: list[Any]) -> list[Tensor]:
        out: list[Tensor] = []
        for kind, what in self.returned:
            if kind == "ext":
                out.append(what)
            elif kind == "arg":
                out.append(arg_tensors[what])
            else:
                slot, device, grad_fn, output_nr = what
                array = kept[self.kept_index[slot]]
                if kind == "node" and nodes:
                    s, j = self.seg_output_index[(id(grad_fn), output_nr)]
                    out.append(Tensor._make(array, nodes[s], j, device))
                else:  # a constant is copied: a change to it must not reach the next replay
                    out.append(Tensor._make(array.copy() if kind == "const" else array,
                                            device=device))
        return out


def _guard_of(t: Any) -> tuple[Any, ...]:
    return (t.data.shape, t.data.dtype, t._device, t._requires_grad)


def _describe(guard: tuple[Any, ...]) -> str:
    shape, dtype, device, requires_grad = guard
    return f"shape {shape}, {dtype}, on {device}, requires_grad={requires_grad}"


class _Analysis:
    """The recorded nodes, newest first, their edges and their segments."""

    def __init__(self, rec: Recorder, program: Program, returned: list[Returned]) -> None:
        self.rec = rec
        self.program = program
        producer: dict[int, tuple[Instr, int]] = {}  # slot -> (instr, output index)
        for instr in rec.instrs:
            for m, slot in enumerate(instr.outs):
                producer[slot] = (instr, m)
        self.instrs = sorted((i for i in rec.instrs if i.kind == "op" and i.node is not None),
                             key=lambda i: -i.node.sequence_nr)
        self.k_of = {id(i.node): k for k, i in enumerate(self.instrs)}
        # Per node, per edge: None, ("inner", k, m), ("ext", i) or ("arg", i).
        self.targets: list[list[tuple[Any, ...] | None]] = []
        self.consumers: dict[tuple[int, int], list[int]] = {}
        arg_of_slot = {slot: what for (kind, what), slot in zip(rec.inputs, rec.input_slots)
                       if kind == "arg"}
        for k, instr in enumerate(self.instrs):
            targets: list[tuple[Any, ...] | None] = []
            for i, next_node in enumerate(instr.node.next_nodes):
                spec = instr.operands[i] if i < len(instr.operands) else ("value", None)
                operand: int | None = spec[1] if spec[0] == "slot" else None
                made = producer.get(operand) if operand is not None else None
                if next_node is None:
                    targets.append(None)
                elif made is not None and made[0].node is next_node:
                    p = self.k_of[id(next_node)]
                    targets.append(("inner", p, made[1]))
                    self.consumers.setdefault((p, made[1]), []).append(k)
                elif operand in program.ext_of_slot:
                    targets.append(("ext", program.ext_of_slot[operand]))
                elif operand in arg_of_slot:
                    targets.append(("arg", arg_of_slot[operand]))
                else:
                    raise Unreplayable(f"{instr.node.name()} sends a gradient along an edge "
                                       f"that capture cannot follow")
            self.targets.append(targets)
        self.returned_keys = {(self.k_of[id(t.grad_fn)], t.output_nr): r
                              for r, t in enumerate(returned)
                              if t.grad_fn is not None and id(t.grad_fn) in self.k_of}
        self.returned = returned
        self.counter_input = self._counters()
        self.returned_on: dict[int, list[int]] = {}  # id(memory owner) -> returned tensors
        for r, t in enumerate(returned):
            self.returned_on.setdefault(id(memory.owner(t.data)), []).append(r)

    def segments(self, keep: Callable[[int], int]
                 ) -> tuple[list[Segment], dict[tuple[int, int], tuple[int, int]]]:
        """The segments, oldest first, and where each output goes: ``(id(node), m)`` ->
        ``(segment, output)``."""
        n = len(self.instrs)
        segment_of = [0] * n
        s = cost = 0
        for k in reversed(range(n)):  # oldest first
            segment_of[k] = s
            cost += self.instrs[k].node.cost
            if cost >= SEGMENT_COST or any(
                    key in self.returned_keys and key in self.consumers
                    for key in ((k, m) for m in range(len(self.instrs[k].outs)))):
                s += 1
                cost = 0
        count = (max(segment_of) + 1) if n else 0
        outputs: list[list[tuple[int, int]]] = [[] for _ in range(count)]
        for k in reversed(range(n)):
            for m in range(len(self.instrs[k].outs)):
                key = (k, m)
                if key in self.returned_keys or any(
                        segment_of[c] != segment_of[k] for c in self.consumers.get(key, ())):
                    outputs[segment_of[k]].append(key)
        index = {key: (s, j) for s, keys in enumerate(outputs) for j, key in enumerate(keys)}
        made = [self._segment([k for k in range(n) if segment_of[k] == s], outputs[s],
                              segment_of, index, keep) for s in range(count)]
        for segment, keys in zip(made, outputs):
            if len(keys) == 1:  # its node is named as the eager node of that tensor
                segment.display_name = self.instrs[keys[0][0]].node.name()
        by_node = {(id(self.instrs[k].node), m): where for (k, m), where in index.items()}
        return made, by_node

    def _counters(self) -> dict[int, tuple[str, int]]:
        """id(version counter) -> the argument or outside tensor it counts, as
        ``("ext" | "arg", index)``."""
        program, found = self.program, {}
        for (kind, i), slot in zip(program.inputs, program.input_slots):
            t = program.externals[i] if kind == "ext" else self.rec.input_tensor.get(slot)
            if t is not None and t._counter is not None:
                found[id(t._counter)] = (kind, i)
        return found

    def _variables(self, members: list[int], outputs: list[tuple[int, int]],
                   segment_of: list[int]) -> tuple[dict[tuple[int, int], int], set[int]]:
        """A segment's gradient variables: one per output ``(k, m)`` of its nodes that
        gets a gradient (from outside the segment, or from its own nodes), and those that
        more than one gradient reaches (added up)."""
        s = segment_of[members[0]]
        variables = {key: v for v, key in enumerate(outputs)}
        reached = dict.fromkeys(variables.values(), 1)  # variable -> gradients reaching it
        for k in members:
            for target in self.targets[k]:
                if target is not None and target[0] == "inner" and segment_of[target[1]] == s:
                    v = variables.setdefault((target[1], target[2]), len(variables))
                    reached[v] = reached.get(v, 0) + 1
        return variables, {v for v, count in reached.items() if count > 1}

    def _segment(self, members: list[int], outputs: list[tuple[int, int]],  # noqa: C901, PLR0915
                 segment_of: list[int], index: dict[tuple[int, int], tuple[int, int]],
                 keep: Callable[[int], int]) -> Segment:
        rec = self.rec
        s = segment_of[members[0]]
        variables, accumulated = self._variables(members, outputs, segment_of)
        incoming = [variables[key] for key in outputs]
        position: dict[int, int] = {}  # slot -> index in the saved tuple

        def saved(value: Any, name: str, output: bool = False) -> tuple[str, Any]:
            slot = rec.array_slot.get(id(value)) if isinstance(value, np.ndarray) else None
            if slot is None:
                if output:
                    raise Unreplayable(f"{name} saved an output capture did not see")
                return ("value", value)  # a constant of the recording
            keep(slot)
            return ("slot", position.setdefault(slot, len(position)))

        def slots_to_positions(spec: Any, name: str) -> Any:
            if spec[0] == "slot":
                return saved(rec.values[spec[1]], name)
            if spec[0] == "tuple":
                return ("tuple", tuple(slots_to_positions(x, name) for x in spec[1]))
            return spec

        plans: list[NodePlan] = []
        edges: list[tuple[str, Any]] = []
        edge_meta: list[Any] = []
        checks: list[Any] = []
        for k in members:
            instr = self.instrs[k]
            node, op = instr.node, instr.fn
            name = node.name()
            gin = tuple(variables.get((k, m)) for m in range(len(instr.outs)))
            saved_arrays, ans_value, _ = instr.saved
            args = tuple(saved(a, name) for a in (saved_arrays or ()))
            ans: Any = None if ans_value is None else [
                saved(a, name, True) for a in ans_value] if op.multi_output else saved(
                ans_value, name, True)
            pspec = None if instr.pspec is None else {
                key: slots_to_positions(spec, name) for key, spec in instr.pspec.items()}
            found = self._checks(instr)
            check_index = None
            if found is not None:
                check_index = len(checks)
                checks.append(found)
            dests: list[tuple[int, tuple[str, int]]] = []
            for i, target in enumerate(self.targets[k]):
                if target is None:
                    continue
                if target[0] == "inner" and segment_of[target[1]] == s:
                    dests.append((i, ("var", variables[(target[1], target[2])])))
                    continue
                dests.append((i, ("out", len(edges))))
                edges.append(("segment", index[(target[1], target[2])])
                             if target[0] == "inner" else (target[0], target[1]))
                edge_meta.append(node._input_meta[i])
            plans.append(NodePlan(node, op, gin, args, ans, pspec, dests, check_index))
        output_meta = tuple(self.instrs[k].node._output_meta[m] for k, m in outputs)
        device = self.instrs[members[0]].node.device if members else CPU
        saved_slots = sorted(position, key=position.__getitem__)
        return Segment(plans, incoming, len(variables), accumulated, edges, edge_meta,
                       output_meta, saved_slots, checks, device)


    def _checks(self, instr: Instr) -> tuple[list[Any], list[Any]] | None:
        """What a replay checks before running ``instr``'s node: the versions of the
        arguments and outside tensors it saved (``(where, kind, index)``) and of the
        returned tensors whose memory it saved (``(where, returned index)``); None:
        nothing."""
        versions = instr.saved[2]
        counter_input = self.counter_input
        inputs_checked = [(r.where, *counter_input[id(r.counter)])
                          for r in versions if id(r.counter) in counter_input]
        returned_checked = []
        items = _saved_items(instr)
        candidates: dict[int, None] = {}
        for _, value in items:
            if type(value) is np.ndarray:
                for r in self.returned_on.get(id(memory.owner(value)), ()):
                    candidates[r] = None
        for r in candidates:
            array = self.returned[r].data
            for where, value in items:
                if type(value) is np.ndarray and np.shares_memory(value, array):
                    # (the saved array's shape and dtype, for the error's message)
                    returned_checked.append((where, r, np.broadcast_to(
                        np.zeros((), value.dtype), value.shape)))
                    break
        return (inputs_checked, returned_checked) if inputs_checked or returned_checked else (
            None)


def _saved_items(instr: Instr) -> list[tuple[int, Any]]:
    """What ``instr``'s node saved: ``(where, value)``, ``where`` as ``SavedVersion``'s."""
    saved_arrays, ans, _ = instr.saved
    items: list[tuple[int, Any]] = list(enumerate(saved_arrays or ()))
    if ans is not None:
        for m, a in enumerate(ans if instr.fn.multi_output else (ans,)):
            items.append((-1 - m, a))
    return items
