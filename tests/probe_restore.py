"""Rank program for the reshard tests: restore the newest step into the current topology and
re-save it, unchanged, to ``checkpoint.local.dir`` + ``-resaved``.

Run it as ``python -m tests.probe_restore CONFIG KEY=VALUE...`` under a launcher, with the same
``--set`` overrides as the training job (``tests/helpers.py``'s ``probe_restore``). With a standby
server beside the launcher it is forwarded there, as ``python -m pretrain`` is: the rank is a fork
of a process that imported torch and Megatron once, not a start that imports them again.
"""

from __future__ import annotations

import os
import sys

from pretrain.resilience.standby.client import forward


def main() -> int:
    # Deferred: torch and Megatron take seconds to import, and a forwarded client never needs them
    # (in the server's fork they are imported already).
    import torch.distributed as dist

    from pretrain.checkpointing.reshardable import ReshardableCheckpoints
    from pretrain.config import load_config
    from pretrain.platform import cpu_shims
    from pretrain.session import build_session
    from tiering.collective import TorchCollective

    overrides = [arg for arg in sys.argv[2:]]
    cfg = load_config(sys.argv[1], overrides)
    cpu_shims.install()
    dist.init_process_group("gloo")
    session = build_session(cfg, dist.get_rank(), dist.get_world_size(), "probe")
    session.tiers.prepare()
    restored = session.tiers.restore(session.state)
    assert restored is not None, "nothing to restore"
    out = cfg.checkpoint.reshardable.dir + "-resaved"
    ReshardableCheckpoints(cfg, TorchCollective(), "probe", directory=out).save(session.state)
    if dist.get_rank() == 0:
        print(f"PROBE restored={restored.step} rng_restored={restored.rng_restored}", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    code = forward("tests.probe_restore")
    sys.exit(main() if code is None else code)
