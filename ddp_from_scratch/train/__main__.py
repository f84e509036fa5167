"""python -m ddp_from_scratch.train: the training program (program.py)."""

import sys

from .program import main

sys.exit(main())
