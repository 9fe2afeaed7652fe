"""`python -m tests.chaos --seed N --jobs J --faults F --duration S`: one chaos run."""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
from pathlib import Path

from tests.chaos.run import Plan, run


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.chaos", description=__doc__)
    parser.add_argument("--seed", type=int, default=None, help="random seed (default: drawn)")
    parser.add_argument("--jobs", type=int, default=12)
    parser.add_argument("--faults", type=int, default=40)
    parser.add_argument("--duration", type=float, default=480.0, help="fault window, seconds")
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--frames", type=int, default=3)
    parser.add_argument("--samples", type=int, default=500)
    parser.add_argument("--lease", type=float, default=2.0, help="FARM_LEASE_TTL_S")
    parser.add_argument(
        "--root",
        type=Path,
        default=None,
        help="keep the run's files (logs, outputs) in this new folder",
    )
    args = parser.parse_args()
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 31)
    plan = Plan(seed=seed, jobs=args.jobs, faults=args.faults, duration_s=args.duration,
                workers=args.workers, frames=args.frames, samples=args.samples,
                lease_ttl_s=args.lease)  # fmt: skip
    if args.root is not None:
        args.root.mkdir(parents=True)
        result = run(plan, args.root)
    else:
        with tempfile.TemporaryDirectory(prefix="tessera-chaos-") as root:
            result = run(plan, Path(root))
    return 1 if result.violations else 0


if __name__ == "__main__":
    sys.exit(main())
