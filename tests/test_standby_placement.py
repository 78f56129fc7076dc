"""A forked rank gets its client's CPU affinity and NUMA memory policy (issue 45 #7): NVRx's numactl
binds the client, and the rank is a fork of the unbound server. Real kernel calls in two processes:
one bound as numactl would bind it reads its placement; another, unbound, applies it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import REPO

BOUND = """
import json, os
from pretrain.resilience.standby import placement
os.sched_setaffinity(0, {0})
why = placement.set_mempolicy(2, [1])  # MPOL_BIND to node 0, as numactl --membind 0
print(json.dumps({"why": why, "placement": placement.read()}))
"""
APPLY = """
import json, sys
from pretrain.resilience.standby import placement
placement.apply(json.loads(sys.argv[1]))
print(json.dumps(placement.read()))
"""


def _python(code: str, *args: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to tell a binding apart")
def test_the_rank_takes_the_clients_cpus_and_memory_policy() -> None:
    bound = json.loads(_python(BOUND))
    if bound["why"] is not None:
        pytest.skip(f"this kernel refuses set_mempolicy: {bound['why']}")
    client = bound["placement"]
    assert client["cpus"] == [0] and client["mempolicy"][0] == 2 and client["mempolicy"][1][0] == 1
    unbound = json.loads(_python(APPLY, json.dumps({})))
    assert len(unbound["cpus"]) > 1 and unbound["mempolicy"][0] == 0  # the server's: unbound
    rank = json.loads(_python(APPLY, json.dumps(client)))
    assert rank == client
