"""`python -m videosparse.cli ...` (and `accelerate launch -m videosparse.cli distill ...`): the `videosparse`
command."""

import sys

from . import main

if __name__ == "__main__":
    sys.exit(main())
