"""Benchmark candidate accelerations on a native pipeline (same as ``worldfoundry bench``).

    python benchmarks/inference/native_plugins.py --model tiny-wan2.1 --candidates recipes/candidates/default.json \
        --out bench_out
"""

from __future__ import annotations

import argparse
import sys

from worldfoundry.cli.bench_cmd import add_arguments, run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
