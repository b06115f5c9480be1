"""A consumer process for test_reader_restart: reads with ack=True, saves each record as
OUT/<rid>.pt (written to a temporary name, then renamed: a file either is complete or is not there),
logs what it did, then acknowledges. A record that comes again after a restart, whose file exists, is
logged as a repeat (with whether it is identical to the saved one) and not saved twice. It takes
SECONDS per record (a slow consumer: the reader has brought in records ahead of it when it is killed).

It handles records in pairs, out of order: it holds the first (A), saves and acknowledges the second (B),
then saves and acknowledges A; a record with no other within 0.5 s is handled alone. B's ack waits for
A's: killed in between, A and B both come again (B as a repeat). Log lines, in order:
`start PID`, then per pair `hold A`, `saved B` (or `repeat B same|DIFFERS`), `acked B`, `saved A`,
`acked A`.

    python ack_consumer.py DUMP_DIR OUT_DIR LOG SECONDS
"""
import os
import sys
import time

import torch

from sglang_hs import HiddenStateReader


def _same(rec, path) -> bool:
    old = torch.load(path)
    return (torch.equal(old["input_ids"], rec.input_ids) and torch.equal(old["aux"], rec.aux_hidden_states)
            and torch.equal(old["last"], rec.last_hidden_state))


def main(dump_dir: str, out: str, log_path: str, seconds: str) -> None:
    reader = HiddenStateReader(dump_dir, ack=True)
    with open(log_path, "a", buffering=1) as log:
        log.write(f"start {os.getpid()}\n")

        def handle(rec):
            time.sleep(float(seconds))
            path = os.path.join(out, f"{rec.rid}.pt")
            if os.path.exists(path):
                log.write(f"repeat {rec.rid} {'same' if _same(rec, path) else 'DIFFERS'}\n")
            else:
                torch.save({"input_ids": rec.input_ids, "aux": rec.aux_hidden_states, "last": rec.last_hidden_state},
                           path + ".tmp")
                os.replace(path + ".tmp", path)
                log.write(f"saved {rec.rid}\n")
            reader.ack(rec)
            log.write(f"acked {rec.rid}\n")

        while True:
            first = reader.next()
            log.write(f"hold {first.rid}\n")
            try:
                second = reader.next(timeout=0.5)
            except TimeoutError:
                handle(first)
                continue
            handle(second)  # acknowledged before the record ahead of it: its bytes wait for first's ack
            handle(first)


if __name__ == "__main__":
    main(*sys.argv[1:5])
