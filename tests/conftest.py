"""One intra-op thread for torch in the test processes and every process they start, and the
heavy tests on one pytest-xdist worker.

The suite runs on two workers (see pyproject.toml) and many tests start peer processes of their
own: with torch's default of one thread per core, their OpenMP threads outnumber the cores and
spin while they wait for each other. Measured on 2 cores beside one busy core, a scoring test
took 32 s with two threads and 23 s with one (31 and 17 s of CPU); in a full suite on two
workers, tests of that kind ran 3-7x their serial time.
"""

from __future__ import annotations

import os

import pytest

# before torch is imported: its thread pools read these once; child processes inherit them
for _name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_name] = "1"

import torch  # noqa: E402

torch.set_num_threads(1)

# Tests that start many peers or processes, or measure a wall-clock run: one worker runs them
# one after another, never beside each other (nodeid prefixes, relative to the project root).
HEAVY = (
    "tests/test_many_peers.py::",  # 16 peers on one event loop
    # 16 peers on one event loop too: beside another heavy test, a late heartbeat left a member
    # out of a view and a round found "no planned member came" (once in 4 suites of one day)
    "tests/test_converge.py::test_sixteen_real_peers_end_with_one_model_after_two_values_rounds",
    "tests/test_churn.py::",  # two swarms of 6 processes
    "tests/test_nat.py::",  # routers and peers in network namespaces
    "tests/test_stale_updates.py::test_stale_updates_leave_the_honest_peers_where_they_would_be_alone",
)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
    """pytest-xdist's ``--dist loadgroup`` with the group taken from :data:`HEAVY`.

    xdist's own grouping (the ``xdist_group`` mark) renames each marked test's nodeid through an
    attribute that pytest 9 no longer reads, so under pytest 9 it silently ran the heavy tests
    on both workers at once (the churn fixture was made on each: 129 s and 146 s of setup).
    """
    if config.getvalue("dist") != "loadgroup":
        return None  # xdist's own choice
    from xdist.scheduler import LoadScopeScheduling

    class HeavyTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return "heavy" if nodeid.startswith(HEAVY) else nodeid

    return HeavyTogether(config, log)
