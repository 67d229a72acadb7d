"""Turn a results folder into one self-contained ``report.html`` (what ``circuitkit report``
does): plotly.js and the circuitsvis bundle inlined once, so it opens offline and can be mailed.

    python examples/report.py RUN_DIR [OUT.html]
"""

from __future__ import annotations

import sys
import time

from circuitkit.experiments.report import describe_written, write_report

if len(sys.argv) < 2:
    sys.exit(__doc__)
t0 = time.perf_counter()
path = write_report(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None)
print(describe_written(path, time.perf_counter() - t0))
