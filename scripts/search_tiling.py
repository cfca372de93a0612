"""Head-aware tiling search (thin entry; the work is in videosparse.distill.search).

    python scripts/search_tiling.py --model reference --prompts prompts.txt --output tiling.json --density 0.1

Every field of `TilingSearchConfig` is a flag (underscores -> dashes, JSON values allowed).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from videosparse.cli import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main(["search-tiling", *sys.argv[1:]]))
