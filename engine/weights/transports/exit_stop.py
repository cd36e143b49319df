"""Background threads that run native code are stopped before the interpreter finalizes.

The prefetch and expert-fetch threads are daemons, so a program that never calls close() still
exits; but a daemon thread inside a C++ call (a GGUF repack, an OpenMP region) keeps running while
Python tears down, and the C++ runtime then aborts the process ("terminate called without an active
exception", exit 134). Each owner of such a thread registers here when it starts one and is closed
by the exit hook unless it closed itself first.
"""

from __future__ import annotations

import atexit
import logging
import weakref
from typing import Protocol

log = logging.getLogger("layerstream")


class Closable(Protocol):
    def close(self) -> None: ...


_owners: weakref.WeakSet = weakref.WeakSet()


def close_at_exit(owner: Closable) -> None:
    _owners.add(owner)


def closed(owner: Closable) -> None:
    _owners.discard(owner)


@atexit.register
def _close_all() -> None:
    for owner in list(_owners):
        try:
            owner.close()
        except Exception as e:  # noqa: BLE001 - at exit, one owner's failure must not keep the others running
            log.warning("closing %s at exit: %s", type(owner).__name__, e)
