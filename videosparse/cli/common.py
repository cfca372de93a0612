"""What several subcommands share: the dtype names, the method arguments and the config they describe, the model
arguments and the --model check."""

from __future__ import annotations

import argparse
import os

import torch

from ..config import (BACKENDS, DEFAULT_DENSITY, DenseConfig, SolConfig, VedaConfig, parse_dense_steps, parse_layers,
                      parse_tile)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _argument(parse):
    """An argparse `type` from a parser that raises ValueError: its message becomes argparse's error."""
    def convert(text: str):
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return convert


def add_method_args(p: argparse.ArgumentParser) -> None:
    """Arguments that describe one attention method (shared by every subcommand that applies one)."""
    p.add_argument("--method", default="veda", choices=["veda", "sol", "dense"], help="attention method")
    p.add_argument("--density", type=float, default=None,
                   help=f"fraction of key tiles kept (default {DEFAULT_DENSITY['veda']} veda / "
                        f"{DEFAULT_DENSITY['sol']} sol)")
    p.add_argument("--tau", type=float, default=None, help="sol: threshold in std devs (instead of --density)")
    p.add_argument("--estimator", nargs="+", default=None, metavar="DIR_OR_HUB_ID",
                   help="veda: trained estimator directory or hub id; on a pipeline of several transformers (Wan "
                        "2.2) one per transformer, each serving the one it was distilled from")
    p.add_argument("--tiling", type=parse_tile, default=None,
                   help="tile shape like 4x4x8 (pt*ph*pw = block); veda also takes a tiling JSON from search-tiling")
    p.add_argument("--block", type=int, default=None, help="tokens per tile (128 or 64)")
    p.add_argument("--dense-steps", type=_argument(parse_dense_steps), default=None,
                   help="initial dense steps: an int count or a float fraction (default 0.2)")
    p.add_argument("--dense-layers", type=_argument(parse_layers), default=None,
                   help="comma-separated layers kept dense")
    p.add_argument("--correction", action=argparse.BooleanOptionalAction, default=None,
                   help="zero-order correction of skipped tiles (default: off for veda, on for sol)")
    p.add_argument("--backend", default=None, choices=list(BACKENDS),
                   help="kernel backend: auto (default), triton, reference or one kernel by name")


# flags that only some methods take (their default is None, so a given one is known)
_METHOD_ONLY = {"density": ("veda", "sol"), "tau": ("sol",), "estimator": ("veda",), "tiling": ("veda", "sol"),
                "block": ("veda", "sol"), "correction": ("veda", "sol"), "dense_steps": ("veda", "sol"),
                "dense_layers": ("veda", "sol"), "backend": ("veda", "sol")}


def method_config(args: argparse.Namespace):
    """The config object the method arguments describe (ValueError for a flag the method does not take)."""
    for name, methods in _METHOD_ONLY.items():
        if getattr(args, name, None) is not None and args.method not in methods:
            flag = name.replace("_", "-")
            raise ValueError(f"--{flag} does not apply to --method {args.method} (only to {' and '.join(methods)}).")
    if args.method == "sol" and isinstance(args.tiling, str):
        raise ValueError(f"--tiling {args.tiling!r}: Sol takes one tile shape like 4x4x8 (pt*ph*pw = block), not a "
                         "tiling file; only --method veda reads a tiling JSON searched by `videosparse search-tiling`.")
    if isinstance(args.tiling, str) and not os.path.isfile(args.tiling):   # before the pipeline loads
        raise ValueError(f"--tiling {args.tiling!r} is neither a tile shape like 4x4x8 nor an existing tiling JSON "
                         "file (written by `videosparse search-tiling`).")
    optional = {k: v for k, v in (("tiling", args.tiling), ("block", args.block), ("correction", args.correction),
                                  ("dense_steps", args.dense_steps), ("dense_layers", args.dense_layers),
                                  ("backend", args.backend)) if v is not None}
    if args.method == "dense":
        return DenseConfig()
    if args.method == "veda":
        return VedaConfig(density=args.density if args.density is not None else DEFAULT_DENSITY["veda"],
                          estimator=args.estimator, **optional)
    if args.tau is not None:
        return SolConfig(tau=args.tau, density=args.density, **optional)   # both given: SolConfig says so
    return SolConfig(density=args.density if args.density is not None else DEFAULT_DENSITY["sol"], **optional)


def check_model(model: str | None) -> None:
    """ValueError when `model` reads as a local path that is not a directory: it starts with / . or ~, has more
    slashes than a hub id's 'org/name' (or a backslash on Windows), or names a file here. diffusers would take it for
    a repo id."""
    if model is None or model in ("reference", "tiny") or os.path.isdir(os.path.expanduser(model)):
        return
    if (model.startswith(("/", ".", "~")) or model.count("/") > 1 or (os.sep != "/" and os.sep in model)
            or os.path.exists(os.path.expanduser(model))):         # a file here, whatever its name's shape
        what = "is a file, not a pipeline directory" if os.path.exists(os.path.expanduser(model)) else "does not exist"
        raise ValueError(f"--model {model!r} looks like a local directory, but it {what}; give an existing diffusers "
                         "pipeline directory, a hub id like Wan-AI/Wan2.1-T2V-1.3B-Diffusers, 'reference' or 'tiny'.")


def add_model_args(p: argparse.ArgumentParser) -> None:
    """--model, --device and --dtype (generate and evaluate)."""
    p.add_argument("--model", default=None,
                   help="hub id or local directory; 'reference' (the default: the shipped model, offline) or 'tiny'")
    p.add_argument("--device", default=None, help="cuda / cpu (default: cuda when available)")
    p.add_argument("--dtype", default=None, choices=sorted(DTYPES), help="default: bf16 on cuda, fp32 on cpu")
