"""Expert and context parallelism's bit-for-bit proofs at 8 ranks: the tests' own comparisons
(tests/expert_parallel, tests/context_parallel), on 8 ranks instead of 2 and 4, on Gloo and on
shm. For a machine with a core a rank (benchmarks/eight_ranks.sh runs it there); on 2 cores it
runs, slowly.

    python -m tests.at_eight_ranks [--ranks 8]
"""

import argparse
import sys

from collectives.testing import run_on_ranks
from tests.context_parallel import test_ring_attention as cp
from tests.expert_parallel import test_expert_parallel as ep


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.at_eight_ranks")
    parser.add_argument("--ranks", type=int, default=8, help="ranks (default 8)")
    n = parser.parse_args(argv).ranks
    for backend in ("gloo", "shm"):
        for case in ep.NAMED:
            run_on_ranks(ep._compare, n, args=(backend, *case.values()), timeout=600)
            print(f"expert parallel, {n} ranks, {backend}, {case}: bit for bit the one-rank layer", flush=True)
        for causal, balanced in cp.MODES:
            run_on_ranks(cp._compare, n, args=(backend, 2, 3, 8, 8, causal, balanced), timeout=600)
            print(f"ring attention, {n} ranks, {backend}, causal={causal} balanced={balanced}: bit for bit torch's "
                  "ring", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
