"""Head-aware tiling search (thin entry; the work is in videosparse.distill.search).

    python scripts/search_tiling.py --model reference --prompts prompts.txt --output tiling.json --density 0.1

Every field of `TilingSearchConfig` is a flag (underscores -> dashes, JSON values allowed).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from videosparse.distill.config import TilingSearchConfig, add_config_arguments, config_from_namespace  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(description="Head-aware tiling search (Veda, arXiv 2605.30325).")
    add_config_arguments(parser, TilingSearchConfig)
    cfg = config_from_namespace(parser.parse_args(argv), TilingSearchConfig)
    from videosparse.distill import run_tiling_search

    res = run_tiling_search(cfg)
    s = res.summary
    print(f"searched tiling: mean relative error {s['mean_rel_err_searched']:.4f}; best single shape "
          f"{s['best_single_shape']}: {s['mean_rel_err_best_single']:.4f} -> {cfg.output}")
    for layer, shapes in enumerate(res.tiling.layers):
        print(f"  layer {layer}: " + " ".join("x".join(map(str, sh)) for sh in shapes))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
