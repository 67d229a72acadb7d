"""Print tests/slow_tests.txt from a ``pytest --durations=0`` log: every test whose call, setup
and teardown took >= THRESHOLD seconds in all (``python tests/slow_from_durations.py LOG``)."""

from __future__ import annotations

import re
import sys
from collections import defaultdict

THRESHOLD = 0.8


def slow_tests(log: str, threshold: float = THRESHOLD) -> list[str]:
    took: dict[str, float] = defaultdict(float)
    for line in log.splitlines():
        m = re.match(r"^\s*([\d.]+)s (?:call|setup|teardown)\s+(\S+)", line)
        if m:
            took[m.group(2)] += float(m.group(1))
    return sorted(name for name, s in took.items() if s >= threshold)


if __name__ == "__main__":
    head = open(__file__).read().split('"""')[1]
    print("\n".join("# " + x for x in head.strip().splitlines()))
    print("\n".join(slow_tests(open(sys.argv[1]).read())))
