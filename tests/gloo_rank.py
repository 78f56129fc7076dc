"""One rank of ``tests/helpers.py``'s ``two_gloo_ranks``: ``python -m tests.gloo_rank RANK SCENARIO
ROOT PORT [BACKEND]`` joins a 2-rank gloo group, runs the pickled ``scenario(rank, root)`` (a
module-level callable, or a ``functools.partial`` of one) and writes its JSON result to
``ROOT/result-RANK.json``.

``BACKEND`` ``fake`` makes the default group torch's fake process group (no communication: every
collective on it gives each rank its own data back) on the same TCP store: it stands in for a NCCL
default group on a CPU host, so that what must run on a gloo group beside it (the control plane)
is proven to, and a collective left on the default group gives a wrong result.

Forwarded to the pytest worker's standby process when the environment names it, as a job's ranks
are: the rank is a fork of a process that imported torch once, not a start that imports it again
(``torch.multiprocessing.spawn`` did that for both ranks of every call).
"""

from __future__ import annotations

import datetime
import json
import os
import pickle
import sys
from pathlib import Path

from pretrain.resilience.standby.client import forward


def main(argv: list[str]) -> int:
    # Deferred: torch takes seconds to import, and a forwarded client never needs it (the server's
    # fork has it already).
    import torch.distributed as dist

    rank, scenario_file, root, port = int(argv[0]), Path(argv[1]), Path(argv[2]), argv[3]
    backend = argv[4] if len(argv) > 4 else "gloo"
    scenario = pickle.loads(scenario_file.read_bytes())
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    if backend == "fake":
        # Registers the "fake" backend (torch's own test process group; deferred: only this case needs it).
        import torch.testing._internal.distributed.fake_pg  # noqa: F401

        store = dist.TCPStore("127.0.0.1", int(port), 2, rank == 0, timeout=datetime.timedelta(minutes=4))
        dist.init_process_group("fake", store=store, rank=rank, world_size=2)
    else:
        dist.init_process_group(backend, rank=rank, world_size=2)
    try:
        result = scenario(rank, root)
        (root / f"result-{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = forward("tests.gloo_rank")
    sys.exit(main(sys.argv[1:]) if code is None else code)
