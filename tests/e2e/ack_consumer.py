"""A consumer process for test_reader_restart: reads with ack=True, saves each record as
OUT/<rid>.pt (written to a temporary name, then renamed: a file either is complete or is not there),
logs what it did, then acknowledges. A record that comes again after a restart, whose file exists, is
logged as a repeat and not saved twice. It takes SECONDS per record (a slow consumer: the reader has
brought in records ahead of it when it is killed).

    python ack_consumer.py DUMP_DIR OUT_DIR LOG SECONDS
"""
import os
import sys
import time

import torch

from sglang_hs import HiddenStateReader


def main(dump_dir: str, out: str, log_path: str, seconds: str) -> None:
    reader = HiddenStateReader(dump_dir, ack=True)
    with open(log_path, "a", buffering=1) as log:
        log.write(f"start {os.getpid()}\n")
        for rec in reader:
            time.sleep(float(seconds))
            path = os.path.join(out, f"{rec.rid}.pt")
            if os.path.exists(path):
                log.write(f"repeat {rec.rid}\n")
            else:
                torch.save({"input_ids": rec.input_ids, "aux": rec.aux_hidden_states, "last": rec.last_hidden_state},
                           path + ".tmp")
                os.replace(path + ".tmp", path)
                log.write(f"saved {rec.rid}\n")
            reader.ack(rec)


if __name__ == "__main__":
    main(*sys.argv[1:5])
