"""`make demo`: the real SGLang server with the sglang-hs overlay on the embedded tiny DeepSeek-V3.

Starts `python -m sglang_hs.launch_server --hs-dump-dir <tmp> --hs-last` (CPU engine when there is no
GPU), sends a few chat requests, reads each request's captured hidden states back from another
process (`HiddenStateReader`), verifies them against HF transformers' `output_hidden_states` on the
same checkpoint, prints a summary and stops the server. Extra arguments go to the launcher, e.g.
`python -m sglang_hs.demo --chunked-prefill-size 16`.
"""
from __future__ import annotations

import glob
import json
import os
import shutil
import sys
import tempfile
import time

import requests

QUESTIONS = [
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "How do I sort a list in Python?",
]


def verify(manifest: dict, records) -> None:
    """Each captured row against HF transformers' output_hidden_states (float32, same checkpoint)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(manifest["model_path"], dtype=torch.float32).eval()
    idx = manifest["hf_output_hidden_states_index"]
    print(f"verification against HF transformers for output_hidden_states{idx}: median relative row "
          f"error / share of rows within 0.05")
    for rec in records:
        with torch.no_grad():
            hs = model(rec.input_ids[None].long(), output_hidden_states=True).hidden_states
        got = list(rec.aux_hidden_states.unbind(1)) + [rec.last_hidden_state]
        errs = [((g.float() - hs[i][0]).norm(dim=-1) / hs[i][0].norm(dim=-1)) for g, i in zip(got, idx)]
        cells = "  ".join(f"[{i}] {e.median():.3f} / {100 * (e < 0.05).float().mean():.0f}%" for i, e in zip(idx, errs))
        print(f"  {rec.rid}: {cells}")
    print("  bf16 server vs float32 reference: ~0.01 is rounding. A row far off is a MoE routing near-tie (a\n"
          "  token whose expert-group scores tie within ~1e-3 is routed differently in bf16; attention then\n"
          "  carries a little of it to later tokens). A wrong layer id would be off by ~0.5 on every row.\n")


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    from sglang_hs.server_process import ServerProcess, ServerStartError

    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    dump_dir = os.path.join(tempfile.mkdtemp(prefix="sglang-hs-demo-", dir=base), "hs")
    log_path = os.path.join(tempfile.gettempdir(), "sglang-hs-demo-server.log")
    server = ServerProcess(["--hs-dump-dir", dump_dir, "--hs-last", *argv], log_path=log_path)
    print("$", " ".join(server.cmd), flush=True)
    url = server.url
    try:
        t0 = time.monotonic()
        try:
            server.wait_ready()
        except ServerStartError as e:
            print(e)
            return 1
        print(f"server ready in {time.monotonic() - t0:.0f}s (log: {log_path})\n")
        from sglang_hs import HiddenStateReader

        reader = HiddenStateReader(dump_dir)
        records = []
        for i, q in enumerate(QUESTIONS):
            t = time.monotonic()
            r = requests.post(f"{url}/v1/chat/completions", timeout=300, json={
                "model": "default", "messages": [{"role": "user", "content": q}], "max_tokens": 16,
                "temperature": 0, "rid": f"demo-{i}"})
            r.raise_for_status()
            out = r.json()
            rec = reader.take(f"demo-{i}", timeout=60)
            records.append(rec)
            print(f"user:      {q}")
            print(f"assistant: {out['choices'][0]['message']['content']!r}")
            print(f"           ({out['usage']['prompt_tokens']} prompt + {out['usage']['completion_tokens']} "
                  f"generated tokens, {time.monotonic() - t:.2f}s; random weights, so the words are noise)")
            print(f"captured:  {rec.num_tokens} rows (prompt + generated - 1): aux {tuple(rec.aux_hidden_states.shape)}"
                  f", last {tuple(rec.last_hidden_state.shape)}\n")
        verify(reader.manifest, records)
        time.sleep(1.2)  # the overlay flushes its status every 0.5 s
        for path in glob.glob(os.path.join(dump_dir, "overlay-*.json")):
            st = json.load(open(path))
            cap = st["capture"]
            print(f"served by:  {st['module']}.{st['class']} (scheduler pid {st['pid']})")
            print(f"capture:    layer ids {cap['layer_ids']} + last = HF output_hidden_states "
                  f"{cap['hf_output_hidden_states_index']} of a {cap['num_hidden_layers']}-layer model")
            print(f"forwards:   {dict(st['forwards'])}; rows {dict(st['rows'])}; packed aux rows of width "
                  f"{st['last_aux_shape'][1]} (= K x hidden)")
        return 0
    finally:
        server.stop()
        shutil.rmtree(os.path.dirname(dump_dir), ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
