"""A trainer on "another host" for tests/unit/test_mooncake.py: a process of its own that takes records from a
publisher through Mooncake, saves each (its tensors and fields) to OUT/<delivery>.pt, confirms it, and after
ACKS confirmations takes one record more, saves it without confirming, says so in OUT/stuck (its rid, written
by rename) and waits there to be killed.

    python mooncake_consumer.py HOST:PORT OUT ACKS
"""
import os
import signal
import sys

import torch

from sglang_hs.extract.transport.mooncake import MooncakeTransport


def save(rec, path: str) -> None:
    torch.save({"rid": rec.rid, "delivery": rec.delivery, "redelivered": rec.redelivered, "seq": rec.seq,
                "prompt_len": rec.prompt_len, "next_token": rec.next_token, "meta": rec.meta,
                "input_ids": rec.input_ids.clone(), "aux": rec.aux_hidden_states.clone(),
                "last": rec.last_hidden_state.clone(), "pre": rec.last_pre_norm.clone(),
                "aux_stride": rec.aux_hidden_states.stride()}, path + ".tmp")
    os.rename(path + ".tmp", path)


def main() -> None:
    address, out, acks = sys.argv[1], sys.argv[2], int(sys.argv[3])
    t = MooncakeTransport(address, ack=True, wait=60)
    for _ in range(acks):
        rec = t.next(timeout=60)
        save(rec, os.path.join(out, f"{rec.delivery}.pt"))
        t.ack(rec)
    t.sync()  # the publisher has those confirmations: the kill cannot take them with it
    rec = t.next(timeout=60)  # taken, saved, never confirmed: the killed consumer's record in hand
    save(rec, os.path.join(out, f"{rec.delivery}.pt"))
    with open(os.path.join(out, "stuck.tmp"), "w") as f:
        f.write(rec.rid)
    os.rename(os.path.join(out, "stuck.tmp"), os.path.join(out, "stuck"))
    while True:
        signal.pause()


if __name__ == "__main__":
    main()
