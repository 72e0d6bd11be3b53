"""``python -m benchmarks --compare REV``: the workloads on this tree and on commit REV, side
by side in one run.

REV's ``pargrad/`` (only that folder) is extracted with ``git archive`` into a temporary
folder, removed afterwards whatever happens (an error, Ctrl-C); nothing is added to the
repository (no worktree to prune). Each tree gets one long-lived process (``worker``),
which puts its tree first on ``sys.path``, checks that ``pargrad`` comes from there, and
runs the benchmark code of *this* tree (``benchmarks/``, ``tests/strategies.py``), so that
both sides run the very same workloads; the benchmark code must therefore run on REV's
pargrad too. Then, workload by workload, rounds alternate between the two processes
(REV, this tree, this tree, REV, ...; the other one waits), so that a noisy stretch of a
few seconds hits both sides of a workload alike; a run in which each process went
through every workload at once measured ratios from 0.06 to 1.9 between two trees with
the same pargrad on a busy machine.

A round runs the workload's share of the repeats (the settings of the mode divided by
the rounds, after the gradient check and one warm-up run) and the mode's memory passes;
the samples of the rounds are pooled per side, and the table gives, for every contender
both sides ran, the medians and REV's over this tree's (above 1: this tree is faster),
the peak backward memory of both, and on tiny-chain the cost per op. Then the targets,
measured on this tree's side, and the reference's peak memory against REV's.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import io
import json
import math
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent  # this tree, whose benchmark code runs
ROUNDS = {"full": 3, "quick": 2, "smoke": 2}
SIDES = ("rev", "current")
_BOOT = ("import sys; sys.path.insert(0, sys.argv[1]); "
         "from benchmarks.compare import worker; sys.exit(worker(sys.argv[1], sys.argv[2]))")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--compare", metavar="REV",
                        help="also run the workloads on git revision REV, interleaved, and "
                             "print REV's medians over this tree's")
    parser.add_argument("--rounds", type=int, metavar="N",
                        help="with --compare: alternations of the two trees "
                             f"(default {ROUNDS['full']}, quick and smoke {ROUNDS['quick']})")


def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True,
                          check=True).stdout.strip()


@contextmanager
def materialised(rev: str) -> Iterator[Path]:
    """A temporary folder holding REV's ``pargrad/``, removed on leaving."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", rev,
                              "pargrad"], capture_output=True, check=True).stdout
    with tempfile.TemporaryDirectory(prefix="pargrad-compare-") as folder, \
            tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        if hasattr(tarfile, "data_filter"):
            tar.extractall(folder, filter="data")
        else:  # Python < 3.11.4: the archive is git's own, of one commit
            tar.extractall(folder)
        yield Path(folder)


# ----- one tree's side: a long-lived process that runs a workload's share on request -----
def worker(tree: str, request_json: str) -> int:
    """Serve the parent: for each line on stdin (a workload's name and a file), run that
    workload's share of the repeats on the pargrad of ``tree`` (first on ``sys.path``),
    write its figures to the file, then answer ``done`` on stdout. Ends at EOF."""
    import pargrad
    here = Path(pargrad.__file__).resolve()
    assert here.is_relative_to(Path(tree).resolve()), f"pargrad from {here}, not {tree}"
    from benchmarks.measure import machine_facts
    from benchmarks.suite import contenders, run_workload, settings
    from benchmarks.workloads import make_workloads
    answers, sys.stdout = sys.stdout, sys.stderr  # stdout is the parent's; prints go aside
    request = json.loads(request_json)
    mode, rounds = request["mode"], request["rounds"]
    full = settings(mode, tuple(request["workers"]), machine_facts()["cores"])
    s = dataclasses.replace(full, repeats=math.ceil(full.repeats / rounds),
                            max_repeats=math.ceil(full.max_repeats / rounds),
                            budget_s=full.budget_s / rounds,
                            warmup=min(full.warmup, 1))  # the gradient check runs first too
    makers, made_workloads = make_workloads(mode), {}
    with contenders(s.workers, s.cores, use_peers=request["peers"]) as made:
        gc.freeze()
        for line in sys.stdin:
            order = json.loads(line)
            name, figures = order["workload"], {"pargrad": str(here), "cores": s.cores,
                                                "default": f"threaded({made.default_workers})"}
            try:
                if name not in made_workloads:
                    made_workloads[name] = makers[name]()
                figures["workload"] = run_workload(made_workloads[name], made, s)
            except ImportError as exc:  # the random DAGs without hypothesis
                figures["skipped"] = str(exc)
            Path(order["out"]).write_text(json.dumps(figures))
            answers.write("done\n")
            answers.flush()
    return 0


class SideFailed(Exception):
    """One side's process did not finish a workload."""


class Side:
    """The process of one tree (``worker``), started with the run's request."""

    def __init__(self, tree: Path, request: dict[str, Any]) -> None:
        self.tree = tree
        self.process = subprocess.Popen(
            [sys.executable, "-c", _BOOT, str(tree), json.dumps(request)], cwd=ROOT,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def run(self, workload: str, out: Path) -> dict[str, Any]:
        """The figures of one share of ``workload`` (blocks until it ran)."""
        assert self.process.stdin is not None and self.process.stdout is not None
        with suppress(BrokenPipeError):  # it died: readline says so below
            self.process.stdin.write(json.dumps({"workload": workload, "out": str(out)}) + "\n")
            self.process.stdin.flush()
        if self.process.stdout.readline().strip() != "done":
            raise SideFailed(f"the benchmark process on the pargrad of {self.tree} failed "
                             f"on {workload} (exit {self.process.wait()}, see above); both "
                             "sides run this tree's benchmark code, which must therefore run "
                             "on REV's pargrad too")
        return dict(json.loads(out.read_text()))

    def close(self) -> None:
        """End the process: EOF, then a kill if it does not end within 10 s."""
        if self.process.stdin is not None:
            with suppress(BrokenPipeError):
                self.process.stdin.close()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


@contextmanager
def running(trees: dict[str, Path], request: dict[str, Any]) -> Iterator[dict[str, Side]]:
    """A running ``Side`` per tree, ended on leaving (an error, Ctrl-C)."""
    sides: dict[str, Side] = {}
    try:
        for name, tree in trees.items():
            sides[name] = Side(tree, request)
        yield sides
    finally:
        for side in sides.values():
            side.close()


# ----- pooling the rounds, the table -----
def _pool(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """The rounds of one workload on one side as one run: samples pooled, the largest
    peak memory."""
    from benchmarks.measure import summary
    first = parts[0]
    merged = {**first, "repeats": sum(p["repeats"] for p in parts),
              "seconds": sum(p["seconds"] for p in parts), "contenders": {}}
    for name, c in first["contenders"].items():
        merged["contenders"][name] = {
            **c, **{part: summary(s for p in parts
                                  for s in p["contenders"][name][part]["samples_s"])
                    for part in ("forward", "backward", "total")},
            **{key: None if c.get(key) is None else
               max(p["contenders"][name][key] for p in parts)
               for key in ("peak_backward_bytes", "peak_bytes")}}
    return merged


def rows(rev: list[dict[str, Any]], current: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For each workload and each contender both sides ran: both medians of forward
    and backward with REV's over this tree's, both peak memories, and per op."""
    out = []
    for old, new in zip(rev, current):
        for name, c in new["contenders"].items():
            if name not in old["contenders"]:
                continue
            was = old["contenders"][name]
            row: dict[str, Any] = {"workload": new["name"], "contender": name,
                                   "fused": c["fused"],
                                   "nodes": {"rev": old["nodes"], "current": new["nodes"]}}
            for part in ("forward", "backward", "total"):
                before, now = was[part]["median_s"], c[part]["median_s"]
                row[part] = {"rev_s": before, "current_s": now, "rev / current": before / now,
                             "rev_us_per_node": before / old["nodes"] * 1e6,
                             "current_us_per_node": now / new["nodes"] * 1e6}
            row["peak_backward_bytes"] = {"rev": was["peak_backward_bytes"],
                                          "current": c["peak_backward_bytes"]}
            row["peak_bytes"] = {"rev": was.get("peak_bytes"), "current": c.get("peak_bytes")}
            out.append(row)
    return out


SLACK_BYTES = 1024
"""How far above REV's peak a tree's reference may go and still count as no higher."""


def memory_targets(table: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per workload, the reference's peak memory during the backward (what the forward's
    graph holds, plus the backward's peak above it) on this tree over REV's (target <= 1:
    no higher than before). Not the backward's peak above its start alone: a tree whose
    graph keeps less after the forward frees less during the backward, so that part
    grows while the real peak falls. Only the reference's: its peak is the same in
    every run, while a ThreadedEngine's depends on how many branches happen to be in
    flight (between two trees with the same pargrad, a quick run measured threaded(1)'s
    on wide-elementwise at 1.33); the table shows every contender's, and this tree's
    targets bound the threaded ones by the reference's. The limit allows ``SLACK_BYTES``
    above REV's (rounded up to the ratio's sixth decimal, so at least that much): a few
    Python objects more or less (an int above 256 in a counter is 32 bytes) are not the
    arrays this target is about."""
    from benchmarks.report import _target
    from benchmarks.suite import SEQUENTIAL
    out: list[dict[str, Any]] = []
    for row in table:
        peak = row["peak_bytes"]
        if row["contender"] == SEQUENTIAL and peak["rev"]:
            _target(out, f"{row['workload']}: {SEQUENTIAL} peak memory, this tree / REV",
                    peak["current"] / peak["rev"],
                    math.ceil((1 + SLACK_BYTES / peak["rev"]) * 1e6) / 1e6,
                    False, "peak memory during the backward, the forward's graph included "
                    f"(the limit: REV's plus {SLACK_BYTES} bytes)")
    return out


def print_table(rev: str, table: list[dict[str, Any]]) -> None:
    print(f"\nbefore/after: medians in ms on {rev} (rev) and this tree (now), rev / now "
          "(above 1: this tree is faster), peak backward MB; fused: forward and backward "
          "in the bw columns")
    header = (f"  {'contender':<28}{'fw rev':>9}{'fw now':>9}{'rev/now':>8}"
              f"{'bw rev':>9}{'bw now':>9}{'rev/now':>8}{'MB rev':>8}{'MB now':>8}")
    workload = None
    for row in table:
        if row["workload"] != workload:
            workload = row["workload"]
            print(f"{workload}:\n{header}")
        fw, peak = row["forward"], row["peak_backward_bytes"]
        bw = row["total" if row["fused"] else "backward"]
        forward = (f"{'fused':>26}" if row["fused"] else f"{fw['rev_s'] * 1e3:9.2f}"
                   f"{fw['current_s'] * 1e3:9.2f}{fw['rev / current']:8.3f}")
        mb = "".join(f"{peak[side] / 2**20:8.2f}" if peak[side] is not None else f"{'':8}"
                     for side in SIDES)
        print(f"  {row['contender']:<28}{forward}{bw['rev_s'] * 1e3:9.2f}"
              f"{bw['current_s'] * 1e3:9.2f}{bw['rev / current']:8.3f}{mb}")
    chain = [row for row in table if row["workload"] == "tiny-chain"]
    if chain:
        print(f"\ntiny-chain per op (µs, {chain[0]['nodes']['current']} nodes): "
              "forward, backward and both, on rev and now")
        print(f"  {'contender':<28}{'fw rev':>8}{'fw now':>8}{'bw rev':>8}{'bw now':>8}"
              f"{'both rev':>9}{'both now':>9}")
        for row in (row for row in chain if not row["fused"]):
            cells = "".join(f"{row[part][f'{side}_us_per_node']:{8 + (part == 'total')}.2f}"
                            for part in ("forward", "backward", "total") for side in SIDES)
            print(f"  {row['contender']:<28}{cells}")


def _interleaved(trees: dict[str, Path], request: dict[str, Any], names: list[str]
                 ) -> tuple[dict[str, dict[str, list[dict[str, Any]]]], dict[str, Any]]:
    """Each workload's rounds on both trees in turn (REV, this tree, this tree, REV,
    ...): the figures of every round per side and workload, and what this tree's
    process says of itself (cores, default engine; ``pargrad``: each side's module).
    Raises SideFailed."""
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {side: {} for side in SIDES}
    answer: dict[str, Any] = {"pargrad": {}}
    with tempfile.TemporaryDirectory(prefix="pargrad-runs-") as tmp, \
            running(trees, request) as sides:
        for name in names:
            for r in range(request["rounds"]):
                print(f"{name}, round {r + 1}/{request['rounds']}", flush=True)
                order = SIDES if r % 2 == 0 else SIDES[::-1]  # rev, now, now, rev, ...
                figures = {side: sides[side].run(name, Path(tmp) / f"{side}.json")
                           for side in order}
                reason = next((f["skipped"] for f in figures.values() if "skipped" in f), None)
                if reason is not None:
                    print(f"skipped {name}: {reason}")
                    break
                for side, answered in figures.items():
                    runs[side].setdefault(name, []).append(answered["workload"])
                    answer["pargrad"][side] = answered["pargrad"]
                answer.update(cores=figures["current"]["cores"],
                              default=figures["current"]["default"])
    return runs, answer


def compare(args: argparse.Namespace, only: list[str] | None, mode: str) -> int:
    """The ``--compare`` run of ``python -m benchmarks`` (``args`` as it parsed them)."""
    from benchmarks import report
    from benchmarks.measure import machine_facts
    started = time.perf_counter()
    try:
        rev = _git("rev-parse", "--verify", f"{args.compare}^{{commit}}")
        changed = _git("status", "--porcelain", "--untracked-files=no", "--", "pargrad")
    except (OSError, subprocess.CalledProcessError) as exc:
        reason = getattr(exc, "stderr", None) or exc
        print(f"compare: {args.compare!r} is not a commit of a git repository at {ROOT}: "
              f"{str(reason).strip()}", file=sys.stderr)
        return 2
    facts = machine_facts()
    rounds = args.rounds or ROUNDS[mode]
    request = {"mode": mode, "rounds": rounds, "only": only, "peers": not args.no_peers,
               "workers": sorted({int(w) for w in args.workers.split(",")}
                                 | {facts["pargrad_default_workers"]})}
    print(f"compare: {args.compare} = {rev[:12]} against this tree (HEAD "
          f"{_git('rev-parse', '--short=12', 'HEAD')}"
          f"{', with changes to pargrad/' if changed else ''}); {mode} run in {rounds} "
          f"rounds of each workload on both, each tree in its own process")
    from benchmarks.workloads import make_workloads, selected
    names = [name for name in make_workloads(mode) if selected(name, only)]
    try:
        with materialised(rev) as old:
            runs, answer = _interleaved({"rev": old, "current": ROOT}, request, names)
    except SideFailed as exc:
        print(f"compare: {exc}", file=sys.stderr)
        return 1
    if args.plot:
        print("no plot with --compare: the plots are of one tree's run")
    pooled = {side: [_pool(parts) for parts in runs[side].values()] for side in SIDES}
    table = rows(pooled["rev"], pooled["current"])
    print_table(args.compare, table)
    targets = [*report.targets(pooled["current"], answer["cores"], answer["default"]),
               *memory_targets(table)]
    if targets:
        report.print_targets(targets, mode)
    seconds = time.perf_counter() - started
    facts["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    print(f"\ncompare run took {seconds:.0f} s; load average at the end "
          f"{facts['load_average_at_end']}")
    if args.json:
        report.write_json(args.json, {
            "machine": facts, "compare": {"rev": args.compare, "commit": rev,
                                          "pargrad": answer["pargrad"], "rounds": rounds,
                                          "request": request},
            "sides": pooled, "rows": table, "targets": targets, "seconds": seconds})
        print(f"wrote {args.json}")
    return 0
