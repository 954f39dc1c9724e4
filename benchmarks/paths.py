"""Import first in a benchmark script (``import paths``): puts this checkout's jqt, the
benchmarks folder and ``examples/`` on ``sys.path``, so that the scripts run as
``python benchmarks/<name>.py`` from anywhere, without installing anything else."""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for _p in (os.path.join(ROOT, "examples"), HERE, ROOT):
    if _p not in sys.path:
        sys.path.insert(0, _p)
