"""sglang_hs/server/patches/sigterm_watchdog.py: SGLang's SIGTERM shutdown begins when the handler runs, not at the
watchdog's next 5 s look at the flag; a flag set without the handler is still seen (upstream's look, kept)."""
import asyncio
import time
from types import SimpleNamespace

import pytest

from sglang_hs.server.patches import sigterm_watchdog


@pytest.fixture
def patched(monkeypatch):
    """The patch applied to SGLang's classes (restored afterwards), upstream's watchdog body replaced by a recorder
    of when it started (it would drain and kill this process tree)."""
    from sglang.srt.managers.tokenizer_manager import SignalHandler, TokenizerManager

    monkeypatch.setattr(TokenizerManager, "sigterm_watchdog", TokenizerManager.sigterm_watchdog)
    monkeypatch.setattr(SignalHandler, "sigterm_handler", SignalHandler.sigterm_handler)
    monkeypatch.setattr(sigterm_watchdog, "ORIGINALS", {})
    sigterm_watchdog.apply()
    started = []

    async def upstream_body(tm):
        assert tm.gracefully_exit  # upstream's own first loop falls through at once
        started.append(time.monotonic())

    monkeypatch.setitem(sigterm_watchdog.ORIGINALS, "sigterm_watchdog", upstream_body)
    return SimpleNamespace(watchdog=TokenizerManager.sigterm_watchdog, handler=SignalHandler.sigterm_handler,
                           started=started)


# Upstream's look at the flag pushed out of reach: a watchdog that ends within DEADLINE was woken by the handler
NEVER, DEADLINE = 3600.0, 60.0


def test_the_handler_starts_the_shutdown_at_once(patched, monkeypatch):
    monkeypatch.setattr(sigterm_watchdog, "POLL_S", NEVER)
    tm = SimpleNamespace(gracefully_exit=False)

    async def main():
        task = asyncio.ensure_future(patched.watchdog(tm))
        await asyncio.sleep(0)  # the watchdog runs up to its wait
        assert not patched.started
        sent = time.monotonic()
        patched.handler(SimpleNamespace(tokenizer_manager=tm))  # as loop.add_signal_handler calls it
        await asyncio.wait_for(task, timeout=DEADLINE)
        return sent

    sent = asyncio.run(main())
    assert tm.gracefully_exit  # upstream's handler ran
    print(f"shutdown began {patched.started[0] - sent:.3f}s after the signal (upstream: up to 5 s)")


def test_the_handler_wakes_a_running_loop_through_the_loop(patched):
    """If the handler ever runs off the loop (a plain signal.signal handler, another thread) while the manager's loop
    runs, the watchdog's event is set through that loop (call_soon_threadsafe): an Event.set() from another thread
    would not wake the loop, and the shutdown would wait for upstream's next look."""
    calls = []
    loop = SimpleNamespace(is_running=lambda: True, call_soon_threadsafe=calls.append)
    tm = SimpleNamespace(gracefully_exit=False, event_loop=loop)
    patched.handler(SimpleNamespace(tokenizer_manager=tm))
    event = sigterm_watchdog._event(tm)
    assert tm.gracefully_exit and len(calls) == 1 and not event.is_set()  # handed to the loop, not set here
    calls[0]()
    assert event.is_set()


def test_applied_twice_it_wraps_once(patched, monkeypatch):
    """A second apply() (a process that applies the server patches again) must not wrap the wrappers, which would
    then call themselves."""
    from sglang.srt.managers.tokenizer_manager import SignalHandler, TokenizerManager

    sigterm_watchdog.apply()
    assert (TokenizerManager.sigterm_watchdog, SignalHandler.sigterm_handler) == (patched.watchdog, patched.handler)


def test_a_signal_before_the_watchdog_runs_is_not_lost(patched, monkeypatch):
    monkeypatch.setattr(sigterm_watchdog, "POLL_S", NEVER)
    tm = SimpleNamespace(gracefully_exit=False)

    async def main():
        patched.handler(SimpleNamespace(tokenizer_manager=tm))
        await asyncio.wait_for(patched.watchdog(tm), timeout=DEADLINE)

    asyncio.run(main())
    assert len(patched.started) == 1


def test_a_flag_set_without_the_handler_is_seen_at_the_next_look(patched, monkeypatch):
    monkeypatch.setattr(sigterm_watchdog, "POLL_S", 0.1)
    tm = SimpleNamespace(gracefully_exit=False)

    async def main():
        task = asyncio.ensure_future(patched.watchdog(tm))
        await asyncio.sleep(0)
        tm.gracefully_exit = True
        await asyncio.wait_for(task, timeout=DEADLINE)

    asyncio.run(main())
    assert len(patched.started) == 1
