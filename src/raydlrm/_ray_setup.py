"""Set-up run in every worker process of a local Ray instance that raydlrm starts
(``runtime_env={"worker_process_setup_hook": ...}``): imports only the standard library, so
that Ray Data's read tasks and actors start no slower for it."""

from __future__ import annotations

import logging

# Ray Train's placement-group cleaner asks the State API (served by the dashboard) every second
# whether the run's controller lives, and warns each time it cannot ask.
_CLEANER_LOGGER = "ray.train.v2._internal.execution.controller.placement_group_cleaner"


def without_dashboard() -> None:
    """For an instance started without its dashboard: the cleaner cannot reach the State API
    and would warn every second (forwarded to the driver's screen); the instance ends with the
    driver, which needs no cleaner. Its errors still show."""
    logging.getLogger(_CLEANER_LOGGER).setLevel(logging.ERROR)
