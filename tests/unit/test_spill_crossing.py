"""spill.crossing_as_file from two threads of one process at once: DataLoader worker 0 runs the record router (its
thread spills the records it hands on) beside its own samples (live.py, the worker's thread), and both register
spill mappings. A full run once failed there: the router stopped on "KeyError: <a storage's address>", both threads
having pruned the same expired entry (tests/unit/test_live_workers.py, spilled-2-fork).

The interleaving is forced, not hoped for: thread A's prune finds an expired entry, and while A checks it, thread B
makes its whole registration (or, where registrations are serialised, B has reached the lock and waits for A)."""
import threading

import pytest
import torch

from sglang_hs import spill


class _WatchedLock:
    """The registrations' lock, telling when thread `waiter` comes to take it (then it may wait for the holder)."""

    def __init__(self, waiter_arrived: threading.Event):
        self._lock, self._arrived, self.waiter = threading.Lock(), waiter_arrived, None

    def __enter__(self):
        if threading.current_thread() is self.waiter:
            self._arrived.set()
        self._lock.acquire()
        return self

    def __exit__(self, *exc):
        self._lock.release()


def test_two_threads_registering_at_once_prune_each_expired_entry_once(monkeypatch):
    monkeypatch.setattr(spill, "_CROSSING", {})
    b_arrived_or_done = threading.Event()
    watched = _WatchedLock(b_arrived_or_done)
    monkeypatch.setattr(spill, "_CROSSING_LOCK", watched, raising=False)
    a_tensor, b_tensor = torch.zeros(4), torch.ones(4)  # alive throughout: their entries must stay
    a_file, b_file = object(), object()
    errors = {}

    def register(name, t, f):
        try:
            spill.crossing_as_file(t, f)
        except BaseException as e:  # noqa: BLE001 - judged below, whichever thread
            errors[name] = e
        finally:
            if name == "B":
                b_arrived_or_done.set()

    b = threading.Thread(target=register, args=("B", b_tensor, b_file), daemon=True)
    watched.waiter = b

    class Expired:
        """A dropped sample's entry: when A's prune asks whether it expired, B registers first."""

        asked = 0

        def expired(self):
            Expired.asked += 1
            if threading.current_thread() is not b and not b.is_alive() and Expired.asked == 1:
                b.start()
                assert b_arrived_or_done.wait(60), "thread B neither registered nor reached the lock"
            return True

    spill._CROSSING[-1] = (Expired(), object())
    register("A", a_tensor, a_file)
    b.join(60)
    assert not b.is_alive()
    assert errors == {}, errors
    got = {key: f for key, (_, f) in spill._CROSSING.items()}
    assert got == {a_tensor.untyped_storage()._cdata: a_file, b_tensor.untyped_storage()._cdata: b_file}
    assert spill._crossing_file(a_tensor[1:]) is a_file and spill._crossing_file(b_tensor) is b_file


def test_a_forked_child_gets_a_lock_of_its_own():
    """The lock is new in a forked child (a DataLoader worker forked while another thread held it would else
    never register)."""
    import os

    with spill._CROSSING_LOCK:
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: the parent's lock is held, the child's must not be
            try:
                os.write(w, b"1" if not spill._CROSSING_LOCK.locked() else b"0")
            finally:
                os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        free = f.read()
    os.waitpid(pid, 0)
    assert free == b"1"


if __name__ == "__main__":
    pytest.main([__file__])
