"""Start-up of a local Ray instance with and without its dashboard (``[ray] include_dashboard``).

Each repeat starts a fresh local instance in a fresh process (``ray.init`` until a first task
has run) alternately with the dashboard on and off, and counts the instance's processes (the
driver's descendants). Prints the median seconds and the process counts per setting.

Usage::

    python benchmarks/ray_startup.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

_CHILD = """
import sys, time, psutil, ray
t = time.perf_counter()
ray.init(address="local", num_cpus=2, object_store_memory=100 * 1024**2,
         include_dashboard=sys.argv[1] == "on", log_to_driver=False)
ray.get(ray.remote(lambda: 1).remote())
seconds = time.perf_counter() - t
print(seconds, len(psutil.Process().children(recursive=True)))
ray.shutdown()
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    runs: dict[str, list[tuple[float, int]]] = {"on": [], "off": []}
    for _ in range(args.repeats):
        for setting in ("on", "off"):
            out = subprocess.run(
                [sys.executable, "-c", _CHILD, setting],
                capture_output=True,
                text=True,
                check=True,
            ).stdout.split()
            runs[setting].append((float(out[0]), int(out[1])))
    summary = {
        setting: {
            "median_seconds": round(statistics.median(s for s, _ in values), 2),
            "seconds": [round(s, 2) for s, _ in values],
            "processes": sorted({n for _, n in values}),
        }
        for setting, values in runs.items()
    }
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
