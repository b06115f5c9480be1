"""Every server: SGLang's SIGTERM shutdown starts when the signal arrives, not up to 5 s later.

SGLang 0.5.23's SIGTERM handler only sets `TokenizerManager.gracefully_exit`; the task that drains the
requests and stops the processes (`TokenizerManager.sigterm_watchdog`) looks at that flag every 5 s
(`await asyncio.sleep(5)`), so every stop idles 0 to 5 s (2.5 s on average) before anything happens. The
handler (installed with `loop.add_signal_handler`, so it runs on the event loop) now also sets an
asyncio event the watchdog waits on; upstream's own 5 s look at the flag stays as the fallback (a flag set
some other way). Once the flag is set the original watchdog runs unchanged: its drain (a 5 s look while
requests remain), its ShutdownReq to the schedulers, its kill of the process tree. Applied in the HTTP
server process (sglang_hs/server/serve.py); see the ledger in sglang_hs/server/patches/__init__.py.
"""
from __future__ import annotations

import asyncio

from sglang_hs.version import SGLANG_VERSION

ORIGINALS = {}
POLL_S = 5.0  # upstream's look at the flag, kept as the fallback
_EVENT = "_sglang_hs_sigterm_event"


def _event(tokenizer_manager) -> asyncio.Event:
    """The manager's event (made on first use; the handler and the watchdog both run on its event loop)."""
    event = getattr(tokenizer_manager, _EVENT, None)
    if event is None:
        event = asyncio.Event()
        setattr(tokenizer_manager, _EVENT, event)
    return event


def apply():
    import sglang
    from sglang.srt.managers.tokenizer_manager import SignalHandler, TokenizerManager

    if sglang.__version__ != SGLANG_VERSION:
        raise RuntimeError(f"sglang-hs patch sigterm_watchdog targets sglang {SGLANG_VERSION}, found {sglang.__version__}")
    if ORIGINALS:  # applied already: wrapping the wrappers would make them call themselves
        return ORIGINALS["sigterm_watchdog"]
    watchdog = ORIGINALS["sigterm_watchdog"] = TokenizerManager.sigterm_watchdog
    ORIGINALS["sigterm_handler"] = SignalHandler.sigterm_handler

    async def sigterm_watchdog(self):
        event = _event(self)
        while not self.gracefully_exit:
            try:
                await asyncio.wait_for(event.wait(), timeout=POLL_S)  # POLL_S read each time (tests)
            except asyncio.TimeoutError:
                pass
        return await ORIGINALS["sigterm_watchdog"](self)  # the flag is set: upstream's drain and shutdown, at once

    def sigterm_handler(self, signum=None, frame=None):
        ORIGINALS["sigterm_handler"](self, signum, frame)
        tm = self.tokenizer_manager
        loop = getattr(tm, "event_loop", None)
        if loop is not None and loop.is_running():  # installed with loop.add_signal_handler: on the loop already;
            loop.call_soon_threadsafe(_event(tm).set)  # from any other thread this is the safe way to wake it
        else:
            _event(tm).set()

    TokenizerManager.sigterm_watchdog = sigterm_watchdog
    SignalHandler.sigterm_handler = sigterm_handler
    return watchdog
