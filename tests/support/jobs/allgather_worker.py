"""One host all-gather between processes that hold different numbers of devices.

Started by hand by ``tests/test_multiprocess.py`` (the launcher gives every process as many
devices): process ``i`` gathers ``[i, 7]`` and prints what it got.
"""

from __future__ import annotations

import numpy as np

import optax_zero_one as ozo
from optax_zero_one.integration import distributed


def main() -> None:
    job = ozo.initialize_from_env()
    got = distributed.host_allgather(np.asarray([job.process_id, 7], np.int32))
    print(f"gathered {job.process_id} {got.tolist()}", flush=True)


if __name__ == "__main__":
    main()
