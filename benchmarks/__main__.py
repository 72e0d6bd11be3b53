"""Run the benchmark suite from the repository root:
``python -m benchmarks [--quick | --smoke] [--only NAME,...] [--workers N,...] [--json FILE]
[--plot FILE] [--no-peers]``.

Prints the machine's facts, a legend, a table per workload (forward and backward medians,
their spread, the reference's backward over each contender's, the peak backward memory),
the speed-up against graph width, the overlap of an asynchronous backward with the rest of
a training step (``benchmarks/overlap.py``), and the targets with their measured ratios,
those that cannot hold on a machine like this one marked **expected** with the reason.
Warns at the top and the bottom when the load average says the machine is busy.
``--json`` saves every figure (each sample); ``--plot`` draws the speed-ups as a PNG
(matplotlib). Compare figures within one run only: the ratios are what carries over, not
the times.
``--compare REV [--rounds N]`` runs the workloads on this tree and on git revision REV,
interleaved, and prints REV's medians over this tree's (``benchmarks/compare.py``).
``python -m benchmarks.tables FILE`` rewrites the tables of README.md and
docs/performance.md from a run saved with ``--json FILE`` (``benchmarks/tables.py``).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from typing import Any

from benchmarks import report
from benchmarks.callers import NAME as CALLERS
from benchmarks.callers import print_callers, run_callers
from benchmarks.capture import NAME as CAPTURE
from benchmarks.capture import capture_targets, print_capture, run_capture
from benchmarks.compare import add_arguments, compare
from benchmarks.data_parallel import NAME as DATA_PARALLEL
from benchmarks.data_parallel import print_data_parallel, run_data_parallel
from benchmarks.measure import machine_facts
from benchmarks.overlap import NAME as OVERLAP
from benchmarks.overlap import run_overlap
from benchmarks.peers import versions
from benchmarks.suite import contenders, run_sweep, run_widths, run_workload, settings
from benchmarks.workloads import make_workloads, selected

WIDE = ("wide-matmul", "wide-elementwise")


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="Time pargrad's engines (and PyTorch and HIPS autograd, if installed) "
                    "on the same graphs, and compare the ratios with the targets in "
                    "docs/performance.md. Run it from the repository root.",
        epilog="The full run takes about 4-6 minutes on 2 cores, --quick about one. Every "
               "figure is a ratio of two medians from the same run; run on a quiet machine.")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true",
                      help="3-15 repeats after 1 warm-up, fewer widths and random DAGs "
                           "(the default is the full run)")
    mode.add_argument("--smoke", action="store_true",
                      help="tiny graphs, one run each: checks that the suite runs")
    parser.add_argument("--only", metavar="NAME,...",
                        help="run only these workloads: wide-matmul, wide-elementwise, "
                             "tiny-chain, fan-in, mlp-step, deep-elementwise, "
                             "softmax-xent, random-dag (every size), small-branches "
                             "(both shapes), overlap, callers, capture, data-parallel")
    parser.add_argument("--workers", metavar="N,...", default="1,2,4",
                        help="the ThreadedEngine worker counts to compare (default 1,2,4)")
    parser.add_argument("--json", metavar="FILE", help="write every figure to FILE")
    parser.add_argument("--plot", metavar="FILE", help="draw the speed-ups into FILE (PNG)")
    parser.add_argument("--no-peers", action="store_true", help="skip PyTorch and HIPS")
    add_arguments(parser)  # --compare REV, --rounds N
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _arguments(argv)
    only = args.only.split(",") if args.only else None
    mode = "smoke" if args.smoke else "quick" if args.quick else "full"
    if args.compare:
        return compare(args, only, mode)
    facts = machine_facts()
    workers = tuple(sorted({int(w) for w in args.workers.split(",")}
                           | {facts["pargrad_default_workers"]}))
    s = settings(mode, workers, facts["cores"])
    started = time.perf_counter()
    figures: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                               "machine": facts, "settings": s.__dict__, "workloads": [],
                               "widths": {}, "skipped_workloads": {}}
    with contenders(workers, s.cores, use_peers=not args.no_peers) as made:
        facts.update(versions(made.peers))
        gc.freeze()  # what exists now is never garbage: collections between runs skip it
        busy = report.load_warning(facts["load_average_at_start"][0], s.cores, before=True)
        if busy:
            print(busy)
        print("machine:")
        for key, value in facts.items():
            print(f"  {key}: {value}")
        report.print_legend()
        print(f"{mode} run: {s.repeats}-{s.max_repeats} repeats after {s.warmup} warm-up "
              f"(as many as fit in {s.budget_s:.0f} s per workload), medians; "
              f"the default engine is threaded({made.default_workers})")
        for name, make in make_workloads(mode).items():
            if not selected(name, only):
                continue
            try:
                workload = make()
            except ImportError as exc:
                figures["skipped_workloads"][name] = (
                    f"needs hypothesis ({exc}): pip install -e '.[bench]'")
                print(f"\nskipped {name}: {figures['skipped_workloads'][name]}")
                continue
            result = run_workload(workload, made, s)
            figures["workloads"].append(result)
            report.print_workload(result)
        for name in WIDE:
            if selected(name, only):
                measured = next(w for w in figures["workloads"] if w["name"] == name)
                figures["widths"][name] = run_widths(name, made, s, measured)
        if "wide-elementwise" in figures["widths"]:
            figures["sweep"] = run_sweep(made, s)
    if selected(OVERLAP, only):
        figures["overlap"] = run_overlap(mode, s.repeats)
        report.print_overlap(figures["overlap"])
    if selected(CALLERS, only):
        figures[CALLERS] = run_callers(mode, s.repeats)
        print_callers(figures[CALLERS])
    if selected(CAPTURE, only):  # pargrad.capture against eager pargrad and PyTorch
        figures[CAPTURE] = run_capture(mode)
        print_capture(figures[CAPTURE])
    if selected(DATA_PARALLEL, only):  # under mpiexec, on 1 and 2 ranks
        figures[DATA_PARALLEL] = run_data_parallel(mode)
        print_data_parallel(figures[DATA_PARALLEL])
    default = f"threaded({made.default_workers})"
    if figures["widths"]:
        report.print_widths(figures["widths"])
    if "sweep" in figures:
        report.print_sweep(figures["sweep"])
    figures["ratios"] = {w["name"]: report.ratios(w, s.cores, default)
                         for w in figures["workloads"]}
    figures["targets"] = report.targets(figures["workloads"], s.cores, default,
                                        figures.get("sweep"), figures.get(CALLERS),
                                        free_threaded=not facts["gil_enabled"],
                                        fused=bool(facts.get("fused_kernels")))
    if CAPTURE in figures:
        figures["targets"] += capture_targets(figures[CAPTURE])
    if figures["targets"]:
        report.print_targets(figures["targets"], mode)
    figures["seconds"] = time.perf_counter() - started
    facts["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    print(f"\n{mode} run took {figures['seconds']:.0f} s; load average at the end "
          f"{facts['load_average_at_end']}")
    busy = report.load_warning(facts["load_average_at_end"][0], s.cores, before=False)
    if busy:
        print(busy)
    if args.json:
        report.write_json(args.json, figures)
        print(f"wrote {args.json}")
    if args.plot:
        try:
            from benchmarks.plots import plot
            plot(args.plot, figures)
        except ImportError as exc:
            print(f"no plot: needs matplotlib ({exc}): pip install -e '.[bench]'")
        else:
            print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
