"""The event loop the tests run on: asyncio's own, or uvloop with CONTROL_STORE_LOOP=uvloop
(`nox -s uvloop`), in the test process and in the worker processes of tests/_workers.py
(they inherit the variable). The CLI's processes run on asyncio's loop, as a user's do."""

from __future__ import annotations

import asyncio
import os
from typing import Final

LOOP: Final = os.environ.get("CONTROL_STORE_LOOP", "asyncio")


def use_requested_loop() -> None:
    """Make asyncio.run, and pytest-asyncio's loops, use the event loop LOOP names."""
    if LOOP == "asyncio":
        return
    if LOOP != "uvloop":
        raise RuntimeError(f"CONTROL_STORE_LOOP={LOOP!r}: set it to 'asyncio' or 'uvloop'")
    import uvloop  # only in `nox -s uvloop`: no dependency of the library or its other tests

    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
