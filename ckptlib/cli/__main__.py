"""`python -m ckptlib.cli ...` (also `torchrun ... -m ckptlib.cli validate ...`): the `ckpt` command."""

import sys

from ckptlib.cli import main

if __name__ == "__main__":
    sys.exit(main())
