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


def test_the_handler_starts_the_shutdown_at_once(patched):
    tm = SimpleNamespace(gracefully_exit=False)

    async def main():
        task = asyncio.ensure_future(patched.watchdog(tm))
        await asyncio.sleep(0.2)  # the watchdog waits
        assert not patched.started
        sent = time.monotonic()
        patched.handler(SimpleNamespace(tokenizer_manager=tm))  # as loop.add_signal_handler calls it
        await asyncio.wait_for(task, timeout=2)
        return sent

    sent = asyncio.run(main())
    assert tm.gracefully_exit  # upstream's handler ran
    print(f"shutdown began {patched.started[0] - sent:.3f}s after the signal (upstream: up to {sigterm_watchdog.POLL_S:g}s)")
    assert patched.started[0] - sent < 0.5


def test_a_signal_before_the_watchdog_runs_is_not_lost(patched):
    tm = SimpleNamespace(gracefully_exit=False)

    async def main():
        patched.handler(SimpleNamespace(tokenizer_manager=tm))
        await asyncio.wait_for(patched.watchdog(tm), timeout=2)

    asyncio.run(main())
    assert len(patched.started) == 1


def test_a_flag_set_without_the_handler_is_seen_at_the_next_look(patched, monkeypatch):
    monkeypatch.setattr(sigterm_watchdog, "POLL_S", 0.1)
    tm = SimpleNamespace(gracefully_exit=False)

    async def main():
        task = asyncio.ensure_future(patched.watchdog(tm))
        await asyncio.sleep(0.25)
        tm.gracefully_exit = True
        await asyncio.wait_for(task, timeout=2)

    asyncio.run(main())
    assert len(patched.started) == 1
