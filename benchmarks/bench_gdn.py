#!/usr/bin/env python
"""Benchmark flashqla's Gated DeltaNet forward/backward against FLA (Triton) and FlashQLA (TileLang).

Same as ``python -m flashqla.bench``; see flashqla/bench.py for the options, e.g.

    python benchmarks/bench_gdn.py --cases anchors
    python benchmarks/bench_gdn.py readme
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from flashqla.bench import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
