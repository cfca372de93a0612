"""`videosparse` command line: parse arguments, call the library.

    videosparse generate [--model ID_OR_DIR] [--method veda|sol|dense] [--density 0.1] ...

One module per subcommand (`generate`, `evaluate`, `distill`, `search_tiling`, `bench`) holds its arguments, its
option checks and what it prints; `common` holds what several share, `config_args` the flags of a config dataclass.
"""

from __future__ import annotations

import argparse
import logging
import sys

from . import bench, distill, evaluate, generate, search_tiling


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="videosparse", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="log INFO messages")
    # -v also after the subcommand; SUPPRESS so that a subcommand without it keeps a -v given before it
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help="log INFO messages")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in (generate, evaluate, distill, search_tiling, bench):
        command.add_parser(sub, common)
    return parser


def given_options(parser: argparse.ArgumentParser, argv: list[str] | None) -> frozenset[str]:
    """The destinations of the options `argv` gives, also where the value given equals the default: `argv` parsed
    again with every default (of the parser and its subcommands) suppressed."""
    saved = []

    def suppress(p: argparse.ArgumentParser) -> None:
        for action in p._actions:
            saved.append((action, action.default))
            action.default = argparse.SUPPRESS
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    saved.append((sub, dict(sub._defaults)))
                    sub._defaults.clear()
                    suppress(sub)

    suppress(parser)
    try:
        return frozenset(vars(parser.parse_args(argv)))
    finally:
        for owner, default in saved:
            if isinstance(owner, argparse.ArgumentParser):
                owner._defaults.update(default)
            else:
                owner.default = default


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.given = given_options(parser, argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    try:
        return args.func(args)
    except (ValueError, OSError) as err:        # bad input, or a file or folder that is not there
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:                   # Ctrl-C: no traceback; what was saved stays (written atomically)
        resumes = {"evaluate": "the cells already measured",
                   "distill": "the samples captured and the last checkpoint"}.get(args.command)
        print("interrupted" + (f"; the same command run again resumes from {resumes}" if resumes else ""),
              file=sys.stderr)
        return 130
