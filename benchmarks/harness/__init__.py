"""What every benchmark in benchmarks/ shares, one concern a module:

  machine        the machine, the code and the moment a result was measured on
  timing         calls timed in turns, with medians and percentiles
  results        results files (.json + .md), markdown tables, the command line, --out
  model_shapes   the parameter shapes of resnet50 and GPT-2 that the step benchmarks time

The scripts run as ``python3 benchmarks/<script>.py``, which puts benchmarks/ first on
sys.path: ``import harness`` finds this package from any of them.
"""
from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]  # benchmarks/
REPO = HERE.parent
RESULTS = HERE / "results"

_FOLDERS = {"python": REPO / "python", "examples": REPO / "examples" / "python",
            "tests": REPO / "tests" / "python"}


def use_paths(*names):
    """Puts this checkout's python/ (the package), examples/python (the demo's models) or
    tests/python (the op tests' input builder) first on sys.path, so that a benchmark measures
    the tree it sits in."""
    for name in names:
        path = str(_FOLDERS[name])
        if path not in sys.path:
            sys.path.insert(0, path)
