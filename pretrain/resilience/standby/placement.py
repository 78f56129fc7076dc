"""Where a rank runs on the node: the client's CPU affinity and NUMA memory policy, carried to the fork.

NVRx >= 0.6 starts each worker under ``numactl --cpunodebind N --membind N`` (or ``--localalloc``)
when ``NVRX_GPUS_PER_NUMA`` is set, and a launcher or Slurm may pin workers with an affinity mask.
Under standby that binds the *client*; the rank is a fork of the unbound server. :func:`read` takes
the client's mask and policy (``sched_getaffinity``, ``get_mempolicy``) into the request and
:func:`apply` sets them in the forked rank before it allocates anything (issue 45 #7).

Owns the two kernel calls each way. Never fails a rank: a policy the kernel refuses (a seccomp
filter, an old kernel) is left as the server's, and the rank says so on stderr. Called by
:mod:`.client` (read) and :mod:`.rank_entry` (apply).
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys
from typing import Any

_LIBC = ctypes.CDLL(None, use_errno=True)
# x86_64 and aarch64 system call numbers (asm/unistd.h)
_SYSCALLS = {"x86_64": (239, 238), "aarch64": (236, 237)}  # (get_mempolicy, set_mempolicy)
_MAX_NODES = 1024  # bits in the node mask passed to the kernel
_WORDS = _MAX_NODES // (8 * ctypes.sizeof(ctypes.c_ulong))
MPOL_DEFAULT = 0


def _mask() -> ctypes.Array[ctypes.c_ulong]:
    return (ctypes.c_ulong * _WORDS)()


def read_mempolicy() -> tuple[int, list[int]] | None:
    """This process's default memory policy: (mode, node-mask words); None where it cannot be read."""
    numbers = _SYSCALLS.get(platform.machine())
    if numbers is None:
        return None
    mode, mask = ctypes.c_int(), _mask()
    if _LIBC.syscall(numbers[0], ctypes.byref(mode), mask, ctypes.c_ulong(_MAX_NODES), None, ctypes.c_ulong(0)):
        return None
    return mode.value, list(mask)


def set_mempolicy(mode: int, words: list[int]) -> str | None:
    """Set this process's memory policy; why not, if the kernel refused."""
    numbers = _SYSCALLS.get(platform.machine())
    if numbers is None:
        return f"no set_mempolicy number for {platform.machine()}"
    mask = _mask()
    mask[: len(words)] = words[:_WORDS]
    if _LIBC.syscall(numbers[1], ctypes.c_int(mode), mask, ctypes.c_ulong(_MAX_NODES)):
        return os.strerror(ctypes.get_errno())
    return None


def read() -> dict[str, Any]:
    """The calling process's placement, for the request (JSON)."""
    return {"cpus": sorted(os.sched_getaffinity(0)), "mempolicy": read_mempolicy()}


def apply(placement: dict[str, Any]) -> None:
    """Give this process (the forked rank) the client's placement; a missing field is left alone."""
    cpus = placement.get("cpus")
    if cpus:
        try:
            os.sched_setaffinity(0, cpus)
        except OSError as exc:
            print(f"standby: the rank keeps the server's CPU affinity ({exc})", file=sys.stderr)
    policy = placement.get("mempolicy")
    if policy and policy[0] != MPOL_DEFAULT:
        why = set_mempolicy(policy[0], policy[1])
        if why:
            print(f"standby: the rank keeps the server's memory policy (set_mempolicy: {why})", file=sys.stderr)
