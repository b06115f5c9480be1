"""patches/dp_controller_idle_wait.py: SGLang's DP controller loop, run on real zmq sockets, dispatches every request
it is sent and, with --sleep-on-idle, waits for the next one instead of spinning (its passes are counted: the
soft watchdog is fed once per pass). Without the patch, or without --sleep-on-idle, the loop spins."""
import threading
import time
import types

import pytest
import zmq

from sglang.srt.managers import data_parallel_controller as dpc
from sglang_hs.server.patches import dp_controller_idle_wait as patch


class _Stop(Exception):
    pass


class _Controller:
    """What event_loop touches: recv_from_tokenizer, soft_watchdog.feed, _request_dispatcher."""

    def __init__(self, sock):
        self.recv_from_tokenizer = sock
        self.feeds = 0
        self.dispatched = []
        self.soft_watchdog = types.SimpleNamespace(feed=self._feed)

    def _feed(self):
        self.feeds += 1

    def _request_dispatcher(self, req):
        if req == "stop":
            raise _Stop
        self.dispatched.append(req)


@pytest.fixture
def sockets():
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    push.connect(f"tcp://127.0.0.1:{port}")
    yield pull, push
    pull.close(0)
    push.close(0)
    ctx.term()


def _run(loop, controller):
    def body():
        try:
            loop(controller)
        except _Stop:
            pass

    t = threading.Thread(target=body, daemon=True)
    t.start()
    return t


def _wait(cond, what, timeout=30):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


@pytest.fixture
def patched(monkeypatch):
    monkeypatch.setattr(patch, "ORIGINALS", {})
    monkeypatch.setattr(dpc.DataParallelController, "event_loop", dpc.DataParallelController.event_loop)
    original = patch.apply()
    return dpc.DataParallelController.event_loop, original


def _sleep_on_idle(monkeypatch, on):
    monkeypatch.setattr(dpc, "get_device", lambda: types.SimpleNamespace(sleep_on_idle=on))


class _Poller(zmq.Poller):
    """zmq's poller, counting the waits it starts and saying whether one is under way."""
    polls = 0
    waiting = False

    def poll(self, timeout=None):
        type(self).polls += 1
        type(self).waiting = True
        try:
            return super().poll(timeout)
        finally:
            type(self).waiting = False


def test_waits_between_requests_and_dispatches_each(sockets, patched, monkeypatch):
    pull, push = sockets
    loop, _ = patched
    _sleep_on_idle(monkeypatch, True)
    monkeypatch.setattr(patch, "IDLE_POLL_MS", 600_000)  # only a request ends a wait within the test
    monkeypatch.setattr(zmq, "Poller", _Poller)
    monkeypatch.setattr(_Poller, "polls", 0)
    c = _Controller(pull)
    t = _run(loop, c)
    for i in range(4):
        if i:
            dpc.sock_send(push, f"req-{i}")
        # waiting again: one wait to start with and one after each request (a spinning loop never waits)
        _wait(lambda: _Poller.waiting and _Poller.polls == i + 1, f"the loop waits after {i} requests")
        assert c.dispatched == [f"req-{j}" for j in range(1, i + 1)]
        assert c.feeds == 1 + 2 * i  # upstream's drain: a feed per request and one for the empty socket
    dpc.sock_send(push, "stop")
    t.join(30)
    assert not t.is_alive()


@pytest.mark.parametrize("which", ["upstream", "patched without --sleep-on-idle"])
def test_spins_without_the_patch_or_the_flag(sockets, patched, monkeypatch, which):
    pull, push = sockets
    loop, original = patched
    _sleep_on_idle(monkeypatch, False)
    c = _Controller(pull)
    t = _run(original if which == "upstream" else loop, c)
    _wait(lambda: c.feeds > 10_000, "a spinning loop's passes")  # the patched loop above makes 3 a request
    dpc.sock_send(push, "stop")
    t.join(30)
    assert not t.is_alive()


def test_apply_is_idempotent(patched):
    loop, original = patched
    assert patch.apply() is original and dpc.DataParallelController.event_loop is loop
