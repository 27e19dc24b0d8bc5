"""Callbacks that do not keep their object alive."""
from __future__ import annotations

import weakref


def weakly(method):
    """A function that calls ``method`` while its object lives, and does
    nothing after. For callbacks held by parameters or by the engine: holding
    their object strongly would keep the runtime, its engine and every bucket
    buffer alive for ever, as the engine's C++ side references the parameters,
    which hides the cycle from Python's garbage collector."""
    ref = weakref.WeakMethod(method)

    def call(*args):
        bound = ref()
        return bound(*args) if bound is not None else None

    return call
