"""python -m ddp_from_scratch.compare: the compare program (program.py)."""

import sys

from .program import main

sys.exit(main())
