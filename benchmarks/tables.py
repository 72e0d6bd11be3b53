"""The docs' benchmark tables, regenerated from a saved run.

``python -m benchmarks.tables [RUN] [--check] [--plot PNG] [--docs FILE ...]`` reads RUN
(a run saved with ``python -m benchmarks --json RUN``; default docs/benchmarks/run.json)
and rewrites, in README.md and docs/performance.md (or the ``--docs`` named), every block
between ``<!-- generated: NAME -->`` and ``<!-- end generated -->`` with the table NAME
made from RUN's figures (``BLOCKS``). Each block says the machine and the date of the run
and the command that regenerates it. Text outside the markers is never touched.
``--check`` writes nothing and exits 1 if a file would change; ``--plot`` redraws the
speed-up plot from RUN as well. Run it from the repository root, as the suite.

Every figure is a ratio of two medians of the run, as the suite prints them: a
speed-up is the reference's (``sequential``'s) backward median over the contender's.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import textwrap
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from benchmarks.peers import TORCH
from benchmarks.report import ceiling_speedup, fastest, median, over_fastest
from benchmarks.suite import SEQUENTIAL, ceiling_names
from benchmarks.workloads import selected

ROOT = Path(__file__).resolve().parent.parent
RUN = "docs/benchmarks/run.json"
DOCUMENTS = ("README.md", "docs/performance.md")
START = "<!-- generated: {name} -->"
END = "<!-- end generated -->"
MARKER = re.compile(r"^<!-- generated: ([\w-]+) -->$", re.MULTILINE)
BLOCK = re.compile(r"^<!-- generated: ([\w-]+) -->\n(.*?)^<!-- end generated -->$",
                   re.MULTILINE | re.DOTALL)
"""A generated block: its name, and the lines between its markers (each marker a line of
its own; a marker quoted inside a line is text)."""

Workload = dict[str, Any]
Column = tuple[str, Callable[[Any], str]]


class Run:
    """A saved run's figures, and the names every block needs."""

    def __init__(self, figures: dict[str, Any], path: str) -> None:
        self.figures = figures
        self.path = path  # as the command that regenerates the blocks names it
        self.machine: dict[str, Any] = figures["machine"]
        self.cores: int = self.machine["cores"]
        self.default = f"threaded({self.machine['pargrad_default_workers']})"

    def workloads(self, *names: str) -> list[Workload]:
        """The workloads that ran among ``names`` (``random-dag``: every size), in run
        order."""
        return [w for w in self.figures["workloads"] if selected(w["name"], list(names))]


def load(path: str | Path) -> Run:
    """The run saved at ``path``; named relative to the repository when inside it."""
    resolved = Path(path).resolve()
    shown = (resolved.relative_to(ROOT).as_posix() if resolved.is_relative_to(ROOT)
             else str(path))
    return Run(json.loads(resolved.read_text()), shown)


# ----- cells -----
def _ratio(value: float | None) -> str:
    return "" if value is None else f"{value:.2f}"


def _ms(seconds: float) -> str:
    ms = seconds * 1e3
    return f"{ms:.0f}" if ms >= 100 else f"{ms:.1f}" if ms >= 10 else f"{ms:.2f}"


def speedup(w: Workload, contender: str) -> float | None:
    """The reference's backward median over ``contender``'s (None if it did not run)."""
    if contender not in w["contenders"]:
        return None
    return median(w, SEQUENTIAL) / median(w, contender)


def torch_speedup(w: Workload) -> float | None:
    """The reference's backward median over the faster PyTorch's (torch, torch(1))."""
    best = fastest(w, TORCH, "backward")
    return None if best is None else median(w, SEQUENTIAL) / best


def engines(rows: Iterable[Workload]) -> list[str]:
    """The ThreadedEngine configurations of ``rows``, in the order they ran."""
    return list(dict.fromkeys(name for w in rows for name, c in w["contenders"].items()
                              if c["kind"] == "engine" and name != SEQUENTIAL))


def table(rows: list[Any], columns: list[Column]) -> list[str]:
    """A Markdown table, a row per item of ``rows``; columns with no value are left out."""
    cells = [[cell(row) for _, cell in columns] for row in rows]
    keep = [i for i in range(len(columns)) if any(line[i] for line in cells)]
    return [
        "| " + " | ".join(columns[i][0] for i in keep) + " |",
        "|" + "---|" * len(keep),
        *("| " + " | ".join(line[i] for i in keep) + " |" for line in cells),
    ]


# ----- what every block says about the run -----
def _blas(pools: list[dict[str, Any]]) -> str:
    names = {"openblas": "OpenBLAS", "mkl": "MKL", "blis": "BLIS"}
    return ", ".join(
        f"{names.get(p['internal_api'], p['internal_api'])} {p['version']} "
        f"({p['architecture']}, {p['num_threads']} threads)" for p in pools) or "no BLAS found"


def _simd(simd: dict[str, list[str]] | None) -> str:
    if not simd:
        return "SIMD not recorded"
    return (f"SIMD: {' '.join(simd['baseline'])} baseline, found "
            f"{' '.join(simd['found']) or 'none'}")


def _fused(m: dict[str, Any]) -> str:
    if "fused_kernels" not in m:
        return "fused kernels not recorded"
    if m["fused_kernels"]:
        load = m.get("fused_kernels_load_s")
        return (f"fused kernels on (numba {m['numba']}"
                + (f", ready in {load:.2f} s" if load is not None else "") + ")")
    return "fused kernels off (" + ("PARGRAD_FUSED=0" if m.get("numba") else "no numba") + ")"


def machine(run: Run) -> str:
    """The run's machine, software and date, and the command that regenerates a block."""
    m, mode = run.machine, run.figures["settings"]["mode"]
    peers = [f"PyTorch {t['version']} ({t['threads']} threads)" for t in [m.get("torch")] if t]
    peers += [f"HIPS autograd {h['version']}" for h in [m.get("hips_autograd")] if h]
    end = m.get("load_average_at_end", ["?"])[0]
    return (f"Measured on {m.get('cpu') or 'a CPU not recorded'}, {run.cores} cores "
            f"({_simd(m.get('simd'))}), {m['python']} "
            f"{'with the GIL' if m['gil_enabled'] else 'free-threaded'}, numpy {m['numpy']} "
            f"with {_blas(m['blas'])}, {_fused(m)}, "
            + (", ".join(peers) if peers else "no peers")
            + f"; {mode} run of {run.figures.get('date', 'an unrecorded date')}, load average"
            f" {m['load_average_at_start'][0]} -> {end}."
            + (" A smoke run: tiny graphs, one repeat each; its figures measure nothing."
               if mode == "smoke" else "")
            + f" Regenerate: `python -m benchmarks.tables {run.path}`.")


def footer(run: Run) -> list[str]:
    return ["", *textwrap.wrap(machine(run), 100, break_on_hyphens=False,
                               break_long_words=False)]


# ----- the blocks -----
def family(run: Run, names: tuple[str, ...], per_node: bool = False) -> list[str]:
    """Speed-ups of every engine configuration, the plain-threads ceiling and PyTorch on
    the workloads ``names``, and forward + backward against the peers."""
    rows = run.workloads(*names)
    if not rows:
        return [f"(no workload of {', '.join(names)} in this run)"]
    d = run.default
    columns: list[Column] = [
        ("workload", lambda w: w["name"]), ("nodes", lambda w: f"{w['nodes']:,}"),
        ("reference backward, ms", lambda w: _ms(median(w, SEQUENTIAL)))]
    if per_node:
        columns.append(("reference, µs per node",
                        lambda w: f"{median(w, SEQUENTIAL) / w['nodes'] * 1e6:.1f}"))
    columns += [(name + (" (default)" if name == d else ""), _speedup_of(name))
                for name in engines(rows)]
    columns += [
        ("plain threads", lambda w: _ratio(ceiling_speedup(w, run.cores))),
        ("PyTorch", lambda w: _ratio(torch_speedup(w))),
        (f"fw+bw, {d} / PyTorch", lambda w: _ratio(over_fastest(w, d, TORCH, "total"))),
        (f"fw+bw, {d} / HIPS", lambda w: _ratio(over_fastest(w, d, ("hips",), "total"))),
    ]
    return table(rows, columns)


def _speedup_of(contender: str) -> Callable[[Workload], str]:
    return lambda w: _ratio(speedup(w, contender))


def memory(run: Run, names: tuple[str, ...]) -> list[str]:
    """Peak backward memory of every engine configuration over the reference's, and of
    plain threads on every core over plain threads on one."""
    rows = [w for w in run.workloads(*names)
            if w["contenders"][SEQUENTIAL]["peak_backward_bytes"]]
    if not rows:
        return []
    one, threads, _ = ceiling_names(run.cores)

    def peak(w: Workload, name: str) -> int | None:
        return w["contenders"][name]["peak_backward_bytes"] if name in w["contenders"] else None

    def of(name: str, base: str) -> Callable[[Workload], str]:
        def cell(w: Workload) -> str:
            top, bottom = peak(w, name), peak(w, base)
            return _ratio(top / bottom) if top is not None and bottom else ""
        return cell

    columns: list[Column] = [
        ("peak backward memory", lambda w: w["name"]),
        ("reference, MB",
         lambda w: f"{w['contenders'][SEQUENTIAL]['peak_backward_bytes'] / 2**20:.1f}")]
    columns += [(f"{name} / reference", of(name, SEQUENTIAL)) for name in engines(rows)]
    columns.append((f"plain threads, {threads} / {one}", of(threads, one)))
    return ["", *table(rows, columns)]


def sweep(run: Run) -> list[str]:
    """wide-elementwise at other shapes: each configuration's speed-up over the ceiling's."""
    rows = run.figures.get("sweep")
    if not rows:
        return ["(the sweep did not run: it runs with wide-elementwise)"]
    threads = ceiling_names(run.cores)[1]
    names = [n for n in next(iter(rows.values())) if n not in (SEQUENTIAL, threads)]

    def ceiling(row: dict[str, Any]) -> float:
        return float(row[SEQUENTIAL]["median_s"] / row[threads]["median_s"])

    def of_ceiling(name: str) -> Callable[[str], str]:
        return lambda key: _ratio(rows[key][SEQUENTIAL]["median_s"]
                                  / rows[key][name]["median_s"] / ceiling(rows[key]))

    columns: list[Column] = [
        ("branches x depth x elements",
         lambda key: " x ".join(f"{int(part):,}" for part in key.split("x"))),
        (f"plain threads ({threads}) speed-up", lambda key: _ratio(ceiling(rows[key])))]
    columns += [(f"{name} / plain threads", of_ceiling(name)) for name in names]
    return table(list(rows), columns)


def overlap(run: Run) -> list[str]:
    """The asynchronous training step against the synchronous one, and data-parallel."""
    out: list[str] = []
    o = run.figures.get("overlap")
    if o:
        out += [f"- {o['name']}: {o['description']}: step median "
                f"{_ms(o['sync_step']['median_s'])} ms synchronous, "
                f"{_ms(o['async_step']['median_s'])} ms asynchronous; sync / async "
                f"{o['sync / async']:.2f}."]
    dp = run.figures.get("data-parallel")
    if dp and "skipped" in dp:
        out.append(f"- data-parallel: skipped ({dp['skipped']}).")
    elif dp:
        steps = "; ".join(f"{name} {_ms(v['step_median_s'])} ms"
                          for name, v in dp["variants"].items())
        ratios = "; ".join(f"{name} {value:.2f}" for name, value in dp["ratios"].items())
        out.append(f"- data-parallel: {dp['description']}: step medians {steps}. "
                   f"Ratios: {ratios}.")
    return out or ["(neither overlap nor data-parallel ran)"]


def _listed(pairs: list[tuple[str, float]]) -> str:
    return ", ".join(f"{name} ({value:.2f})" for name, value in pairs) or "none"


def summary(run: Run) -> list[str]:
    """The run's headline figures, in sentences."""
    d, out = run.default, []
    for w in run.workloads("wide-elementwise", "fan-in", "wide-matmul", "deep-elementwise"):
        ceiling = ceiling_speedup(w, run.cores)
        out.append(f"- {w['name']}: the default engine's backward ran at "
                   f"{_ratio(speedup(w, d))}x the reference's speed"
                   + (f"; plain threads, {_ratio(ceiling)}x." if ceiling else "."))
    small = run.workloads("tiny-chain", "random-dag")
    found = [s for w in small for n in engines([w]) if (s := speedup(w, n)) is not None]
    if found:
        out.append(f"- Graphs of small nodes ({', '.join(w['name'] for w in small)}): every "
                   f"engine configuration at {min(found):.2f}-{max(found):.2f}x the "
                   "reference's speed.")
    for peer, label in ((TORCH, "PyTorch"), (("hips",), "HIPS autograd")):
        pairs = [(w["name"], value) for w in run.figures["workloads"]
                 if (value := over_fastest(w, d, peer, "total")) is not None]
        if pairs:
            out.append(f"- Forward + backward, the default engine's time over {label}'s: "
                       f"faster on {_listed([p for p in pairs if p[1] < 1])}; slower on "
                       f"{_listed([p for p in pairs if p[1] >= 1])}.")
    verdicts = [t for t in run.figures["targets"] if t["holds"] is not None]
    failed = [t for t in verdicts if not t["holds"]]
    expected = [f"{t['target']} ({t['value']:.2f})" for t in failed if t["expected_failure"]]
    news = [f"{t['target']} ({t['value']:.2f})" for t in failed if not t["expected_failure"]]
    out.append(f"- Targets: {len(verdicts) - len(failed)} of {len(verdicts)} hold. "
               f"Failed as expected on a machine like this one: {'; '.join(expected) or 'none'}."
               f" Failed: {'; '.join(news) or 'none'}.")
    return out


README_ROWS = {
    "wide-elementwise": "independent branches of large elementwise ops",
    "fan-in": "one leaf read by many consumers",
    "wide-matmul": "independent branches of matmuls",
    "deep-elementwise": "a chain of large elementwise ops",
    "tiny-chain": "a chain of ops on 100 elements",
    "random-dag": "random DAGs of small nodes",
    "mlp-step": "MLP training step, float32",
    "softmax-xent": "classifier head: matmul, log_softmax, NLL",
}


def readme(run: Run) -> list[str]:
    """The README's table: the default engine, plain threads and PyTorch, per workload
    (of the random DAGs, the largest)."""
    dags = run.workloads("random-dag")
    rows = [w for w in run.workloads(*README_ROWS)
            if not w["name"].startswith("random-dag") or w is dags[-1]]
    d = run.default
    return table(rows, [
        ("workload", lambda w: f"{w['name']}: {README_ROWS[w['name'].split(':')[0]]}"),
        (f"default engine, {d}", lambda w: _ratio(speedup(w, d))),
        ("plain threads", lambda w: _ratio(ceiling_speedup(w, run.cores))),
        ("PyTorch", lambda w: _ratio(torch_speedup(w))),
        ("forward + backward, pargrad / PyTorch",
         lambda w: _ratio(over_fastest(w, d, TORCH, "total"))),
    ])


WIDE = ("wide-matmul", "wide-elementwise", "fan-in")


def figures(run: Run) -> list[str]:
    """A table per workload family, the sweep, and the training-step workloads."""
    return [
        "**Wide graphs**: backward speed-ups, forward + backward against the peers, then "
        "peak backward memory over the reference's.", "", *family(run, WIDE),
        *memory(run, WIDE), "",
        "**Small nodes** (run inline: every configuration runs the reference's loop):", "",
        *family(run, ("tiny-chain", "random-dag"), per_node=True), "",
        "**Large arrays and matmuls:**", "",
        *family(run, ("deep-elementwise", "softmax-xent", "mlp-step")), "",
        "**The wide-elementwise sweep**: each configuration's speed-up over the plain-threads "
        "ceiling's.", "", *sweep(run), "",
        "**Training steps** (asynchronous backward; data-parallel over MPI):", "",
        *overlap(run)]


BLOCKS: dict[str, Callable[[Run], list[str]]] = {
    "summary": summary,
    "figures": figures,
    "readme": readme,
}
"""Each block's name (in its start marker) and what makes its lines."""


def render(name: str, run: Run) -> str:
    """The lines between the markers of block ``name`` (prose wrapped at 90, tables not)."""
    if name not in BLOCKS:
        raise ValueError(f"unknown generated block {name!r}: the blocks are "
                         f"{', '.join(BLOCKS)} (benchmarks/tables.py)")
    lines = [wrapped for line in BLOCKS[name](run) for wrapped in (
        textwrap.wrap(line, 90, subsequent_indent="  " if line.startswith("- ") else "",
                      break_on_hyphens=False, break_long_words=False) or [""]
        if not line.startswith("|") else [line])]
    return "\n".join([*lines, *footer(run)]) + "\n"


def rewrite(text: str, run: Run) -> str:
    """``text`` with every generated block (its markers each on a line of their own)
    made anew from ``run``."""
    blocks = list(BLOCK.finditer(text))
    if len(MARKER.findall(text)) != len(blocks) or any(MARKER.search(b.group(2))
                                                        for b in blocks):
        raise ValueError(f"a '<!-- generated: NAME -->' line without its '{END}' line")
    return BLOCK.sub(lambda m: START.format(name=m.group(1)) + "\n"
                      + render(m.group(1), run) + END, text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.tables",
        description="Rewrite the generated benchmark tables of README.md and "
                    "docs/performance.md from a run saved with python -m benchmarks --json.")
    parser.add_argument("run", nargs="?", default=str(ROOT / RUN),
                        help=f"the saved run (default {RUN})")
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 if a document would change")
    parser.add_argument("--plot", metavar="PNG", help="redraw the speed-up plot into PNG")
    parser.add_argument("--docs", nargs="+", metavar="FILE", default=[str(ROOT / d)
                        for d in DOCUMENTS], help="the documents (default: " +
                        ", ".join(DOCUMENTS) + ")")
    args = parser.parse_args(argv)
    run = load(args.run)
    stale = []
    for path in map(Path, args.docs):
        text = path.read_text()
        new = rewrite(text, run)
        if new != text:
            stale.append(str(path))
            if not args.check:
                path.write_text(new)
    if args.plot:
        from benchmarks.plots import plot
        plot(args.plot, run.figures)
    verb = "would change" if args.check else "rewrote"
    print(f"{verb}: {', '.join(stale)}" if stale else "the tables match " + run.path)
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
