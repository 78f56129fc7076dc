"""Reading Linux's ``/proc/<pid>/stat``: the one parsing every caller shares.

The command name (field 2) is in parentheses and may itself hold spaces and parentheses, so the
fields are those after its *last* closing parenthesis; :func:`stat_fields` returns them from
field 3 (the state) on, so field N of proc(5) is ``fields[N - 3]``.
"""

from __future__ import annotations

from pathlib import Path

STATE = 0  # field 3: R, S, D (uninterruptible sleep), Z (zombie), T (stopped), ...
START_TICKS = 19  # field 22: the process's start, in clock ticks since boot
EXIT_CODE = 49  # field 52: the wait status of a process that ended (Linux 3.5+)


def stat_fields(stat_file: Path) -> list[str]:
    """The fields of a ``stat`` file (``/proc/<pid>/stat`` or ``/proc/<pid>/task/<tid>/stat``)
    after the command name. Raises OSError when the process is gone."""
    return stat_file.read_text().rsplit(")", 1)[1].split()


def is_running(pid: int) -> bool:
    """Whether ``pid`` exists and has not exited (a zombie has)."""
    try:
        return stat_fields(Path(f"/proc/{pid}/stat"))[STATE] != "Z"
    except (OSError, IndexError):
        return False
