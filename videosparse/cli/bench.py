"""`videosparse bench` (and scripts/bench_kernel.py): the kernel benchmark's options, their checks, the run with its
progress lines on stdout, and the summary and tables it prints (the work is `videosparse.eval.kernel_bench`)."""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import os
import sys
from functools import partial
from pathlib import Path

from .._io import STANDARD_STREAMS
from .._run_checks import check_output
from ..eval import kernel_bench
from ..eval.kernel_bench import SHAPES

say = partial(print, flush=True)


def add_arguments(ap: argparse.ArgumentParser, default_out: str) -> None:
    """The benchmark's options on `ap` (the `videosparse bench` subcommand's and the script's parser)."""
    ap.add_argument("--quick", action="store_true", help="fewer shapes and densities")
    ap.add_argument("--out", default=default_out, help=f"the JSON written, after each step (default {default_out})")
    ap.add_argument("--shapes", nargs="*", help=f"subset of {list(SHAPES)} (given empty: none, e.g. with --item-sweep)")
    ap.add_argument("--no-peers", action="store_true", help="skip Flex and FA4")
    ap.add_argument("--no-variants", action="store_true")
    ap.add_argument("--item-sweep", action="store_true",
                    help="also fit the fixed cost per work item and the cost per key tile (fixed-count plans), ours "
                         "and FA4's (unless --no-peers)")
    ap.add_argument("--rounds", type=int, default=3,
                    help="timings per implementation, interleaved with the others of the same shape and plan; "
                         "the median is reported (default 3)")
    ap.add_argument("--deadline-s", type=float, default=480.0, help="stop starting new timings after this")
    ap.add_argument("--readme", metavar="JSON", help="only render the markdown table of an earlier run")


def check_args(args: argparse.Namespace, error) -> None:
    """`error(message)` (argparse's, which exits 2) for an unknown shape, rounds < 1 or a deadline that is no time."""
    unknown = [name for name in args.shapes or () if name not in SHAPES]
    if unknown:
        error(f"--shapes {unknown} unknown; choose from {list(SHAPES)}")
    if args.rounds < 1:
        error(f"--rounds {args.rounds} must be >= 1")
    if not math.isfinite(args.deadline_s) or args.deadline_s <= 0:
        error(f"--deadline-s {args.deadline_s} must be a finite number of seconds > 0")
    for flag, value in (("--out", args.out), ("--readme", args.readme)):
        if value == "":
            error(f"{flag} is empty; give a JSON file path")
    if args.readme is None:         # an --out that cannot be written: now, not after the correctness checks
        out = args.out
        real = os.path.realpath(out)
        stream = out in STANDARD_STREAMS or (os.path.exists(out) and not os.path.isfile(real)
                                             and not os.path.isdir(real) and real != os.devnull)
        try:
            if stream or out.endswith(("/", os.sep)):
                raise ValueError(f"--out {out!r} is no regular file: the benchmark writes its JSON again after each "
                                 "step; give a JSON file path.")
            check_output("--out", out, parents=True)                # (its folder is made with its parents)
        except ValueError as err:
            error(str(err))


def add_parser(sub, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("bench", parents=[common], formatter_class=argparse.RawDescriptionHelpFormatter,
                       help="the kernel benchmark (GPU): ours against cuDNN SDPA, FlexAttention and FA4 block-sparse",
                       description=kernel_bench.__doc__)
    add_arguments(p, default_out="kernel_bench.json")

    def bench(args) -> int:
        check_args(args, p.error)
        return run(args)

    p.set_defaults(func=bench)


def parse_args(argv=None, default_out: str = "kernel_bench.json") -> argparse.Namespace:
    """The script's options (scripts/bench_kernel.py: its own parser, no subcommand), checked."""
    ap = argparse.ArgumentParser(description=kernel_bench.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(ap, default_out)
    args = ap.parse_args(argv)
    check_args(args, ap.error)
    return args


def main(argv=None, default_out: str = "kernel_bench.json") -> int:
    """The benchmark from command-line arguments; exit code 1 when a correctness check failed or a step raised."""
    return run(parse_args(argv, default_out))


@contextlib.contextmanager
def _progress_on_stdout():
    """The benchmark's progress lines (`kernel_bench`'s INFO log) on stdout, one message a line and flushed, whatever
    the root logger's level; not passed on to the root logger's handlers, so `-v` does not print them twice."""
    log = logging.getLogger(kernel_bench.__name__)
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(message)s"))
    saved = log.level, log.propagate
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False
    try:
        yield
    finally:
        log.removeHandler(handler)
        log.setLevel(saved[0])
        log.propagate = saved[1]


def run(args: argparse.Namespace) -> int:
    """The benchmark (`parse_args`' options); exit code 1 when a correctness check failed or a step raised."""
    if args.readme is not None:
        try:
            tables = kernel_bench.readme_tables(args.readme)
        except ValueError as err:
            raise SystemExit(str(err)) from None
        print(tables)
        return 0
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("the kernel benchmark needs a CUDA GPU.")
    with _progress_on_stdout():
        results = kernel_bench.run_benchmark(args)
    checks = results["correctness"]
    say(f"wrote {Path(args.out)} ({results['meta']['wall_s']:.0f} s); correctness: "
        f"{len(checks) - sum(not c['ok'] for c in checks)}/{len(checks)} ok")
    for e in results["errors"]:
        say("error:", e[:300])
    for d in kernel_bench.disagreements(results):
        say("disagrees (its time is of another computation):", d)
    say(kernel_bench.report_tables(results))
    return kernel_bench.exit_code(results)
