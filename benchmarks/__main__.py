"""``python -m benchmarks``: throughput and resume benchmarks (see `benchmarks.throughput`)."""

import sys

from benchmarks.throughput import main

if __name__ == "__main__":
    sys.exit(main())
