"""CPU mode, data parallelism: SGLang's DP controller waits for requests instead of spinning a core.

SGLang 0.5.23's `DataParallelController.event_loop` (managers/data_parallel_controller.py) takes requests off
its socket with NOBLOCK receives and, when none is there, loops straight back: the `sglang::data_parallel_controller`
process of every `--dp` server uses a whole core for as long as the server lives, busy or idle. `--sleep-on-idle`,
which the launcher gives the CPU engine, stops only the schedulers' spinning (their IdleSleeper); on a machine of
two cores the controller then took ~80% of one from the schedulers, the HTTP server and everything else.

With `--sleep-on-idle` the loop below drains the socket exactly as upstream's does (a watchdog feed and one
dispatch per request), then waits on a zmq poller over that socket, as the schedulers' IdleSleeper does: a
request wakes it at once, and it looks again at least every IDLE_POLL_MS (so the soft watchdog is still fed).
Without `--sleep-on-idle` upstream's loop runs. Applied in every spawned SGLang process in CPU mode (`apply_spawned`:
the controller is one); see the ledger in sglang_hs/server/patches/__init__.py.
"""
from __future__ import annotations

from sglang_hs.version import SGLANG_VERSION

ORIGINALS = {}
IDLE_POLL_MS = 1000  # upstream's IdleSleeper's wait; read at each wait (tests)


def apply():
    import sglang
    import zmq
    from sglang.srt.managers import data_parallel_controller as dpc

    if sglang.__version__ != SGLANG_VERSION:
        raise RuntimeError(f"sglang-hs patch dp_controller_idle_wait targets sglang {SGLANG_VERSION}, "
                           f"found {sglang.__version__}")
    if ORIGINALS:
        return ORIGINALS["event_loop"]
    original = ORIGINALS["event_loop"] = dpc.DataParallelController.event_loop

    def event_loop(self):
        if not dpc.get_device().sleep_on_idle:
            return original(self)
        poller = zmq.Poller()
        poller.register(self.recv_from_tokenizer, zmq.POLLIN)
        while True:
            while True:  # upstream's drain, unchanged
                self.soft_watchdog.feed()
                try:
                    recv_req = dpc.sock_recv(self.recv_from_tokenizer, flags=zmq.NOBLOCK)
                except zmq.ZMQError:
                    break
                self._request_dispatcher(recv_req)
            poller.poll(IDLE_POLL_MS)

    dpc.DataParallelController.event_loop = event_loop
    return original
