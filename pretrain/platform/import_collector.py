"""The cyclic garbage collector kept out of a process's start-up imports.

Importing what a rank runs (torch, Megatron Core, NVRx, Dynamo: ~3 000 modules, ~360 k objects
that live as long as the process) allocates far past the collector's thresholds, so it collects
again and again while the heap grows, each full collection walking everything imported so far:
a quarter of the import's time. Measured on this project's 2-core CPU host, the standby server's
preload took 4.0-4.3 s with the collector on and 2.9-3.2 s with it paused (two runs each).

:func:`imports_without_collecting` pauses it for the imports and then moves everything they made to
the collector's permanent generation (``gc.freeze``, which also resets its allocation counts), so
no collection of the whole heap follows either: later collections walk only what training makes.
That is CPython's own advice for processes that fork after their imports (the standby server) and
as good for one that trains after them. Everything that exists at the end is frozen, not only
the imports' objects (in a rank also its config), and a frozen object is never collected, even if
it later ends in a cycle; what the imports leave as cyclic garbage is frozen with the rest instead
of being freed (~9 000 objects, ~7 MB, measured after the preload): a few megabytes per process
bought for a second of every start.

Owns only the collector's state around the imports; never imports anything itself.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def imports_without_collecting(freeze: bool = True) -> Iterator[None]:
    """Run the body (imports) with the cyclic collector off, then freeze what exists and restore
    the collector's state. On an exception the collector's state is restored without the freeze.
    ``freeze=False``: only the pause, for a caller that may run inside a long-lived process whose
    own garbage must stay collectable (a command's ``main`` called in-process)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
        if freeze:
            gc.freeze()
    finally:
        if enabled:
            gc.enable()
