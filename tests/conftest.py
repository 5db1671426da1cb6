"""One intra-op thread for torch in the test processes and every process they start.

The suite runs on two workers (see pyproject.toml) and many tests start peer processes of their
own: with torch's default of one thread per core, their OpenMP threads outnumber the cores and
spin while they wait for each other. Measured on 2 cores beside one busy core, a scoring test
took 32 s with two threads and 23 s with one (31 and 17 s of CPU); in a full suite on two
workers, tests of that kind ran 3-7x their serial time.
"""

from __future__ import annotations

import os

# before torch is imported: its thread pools read these once; child processes inherit them
for _name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_name] = "1"

import torch  # noqa: E402

torch.set_num_threads(1)
