"""`make demo`: the real SGLang server with the sglang-hs overlay on the embedded tiny DeepSeek-V3.

Starts `python -m sglang_hs.launch_server --hs-dump-dir <tmp> --hs-last` (CPU engine when there is no
GPU), sends a few chat requests, reads each request's captured hidden states back from another
process (`HiddenStateReader`) and stops the server. Then it checks the rows: the same token sequences
go through a second, float32 server, and every captured row of every layer is compared on its own
with HF transformers' float32 `output_hidden_states` on the same checkpoint (the exact check); the
bf16 rows of the first server are summarised beside it. Extra arguments go to both launchers, e.g.
`python -m sglang_hs.demo --chunked-prefill-size 16`.
"""
from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time

import requests
import torch

QUESTIONS = [
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "How do I sort a list in Python?",
]
EXACT_TOL = 1e-4  # float32 server vs HF float32: ~1e-6 per row is rounding; a wrong row is off by > 0.1


def row_errors(manifest: dict, records):
    """Per record, per captured state: the relative error ||got - ref|| / ||ref|| of each row against HF
    transformers' float32 output_hidden_states of the same token ids ([states, rows])."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(manifest["model_path"], dtype=torch.float32).eval()
    idx = manifest["hf_output_hidden_states_index"]
    out = []
    for rec in records:
        with torch.no_grad():
            hs = model(rec.input_ids[None].long(), output_hidden_states=True).hidden_states
        got = list(rec.aux_hidden_states.unbind(1)) + ([rec.last_hidden_state] if manifest["last"] else [])
        out.append(torch.stack([(g.double() - hs[i][0].double()).norm(dim=-1) / hs[i][0].double().norm(dim=-1)
                                for g, i in zip(got, idx)]))
    return out


def exact_pass(argv, base, records, log_path) -> bool:
    """The records' token sequences through a float32 server; every row judged against HF float32."""
    from sglang_hs import HiddenStateReader
    from sglang_hs.tools.server_process import ServerProcess

    dump_dir = os.path.join(tempfile.mkdtemp(prefix="sglang-hs-demo-fp32-", dir=base), "hs")
    server = ServerProcess(["--hs-dump-dir", dump_dir, "--hs-last", *argv, "--dtype", "float32"], log_path=log_path)
    print("$", " ".join(server.cmd), flush=True)
    try:
        server.wait_ready()
        reader = HiddenStateReader(dump_dir)
        exact = []
        for rec in records:  # the prompt and the generated tokens: one row each, in one prefill
            requests.post(f"{server.url}/generate", timeout=300, json={
                "input_ids": rec.input_ids.tolist(), "rid": rec.rid, "sampling_params": {"max_new_tokens": 1}}
            ).raise_for_status()
            exact.append(reader.take(rec.rid, timeout=60))
        manifest = reader.manifest
    finally:
        server.stop()
        shutil.rmtree(os.path.dirname(dump_dir), ignore_errors=True)
    idx = manifest["hf_output_hidden_states_index"]
    errors = row_errors(manifest, exact)
    ok = True
    print(f"exact check: every row of output_hidden_states{idx}, float32 server vs HF transformers float32, "
          f"each row within {EXACT_TOL:g} relative error")
    for rec, e in zip(exact, errors):
        bad = int((e > EXACT_TOL).sum())
        ok &= bad == 0
        print(f"  {rec.rid}: {e.shape[1]} rows x {e.shape[0]} states: "
              f"{'every row matches' if bad == 0 else f'{bad} rows OFF'} (worst {e.max():.1e})")
    return ok


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    from sglang_hs.tools.server_process import ServerProcess, ServerStartError

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
        e = torch.cat([x.flatten() for x in row_errors(reader.manifest, records)])
        print(f"bf16 rows vs HF float32: median relative error {e.median():.3f}, {100 * (e < 0.05).float().mean():.0f}% "
              "within 0.05: bf16 rounding through MLA and MoE,\nlarger where bf16 flips a MoE routing near-tie; "
              "so rows are judged one by one in float32 below.\n")
        from sglang_hs import status

        for st in status.settled(dump_dir)["files"]:  # a snapshot written after the last reply, all published
            cap = st["capture"]
            print(f"served by:  {st['module']}.{st['class']} (scheduler pid {st['pid']})")
            print(f"capture:    layer ids {cap['layer_ids']} + last = HF output_hidden_states "
                  f"{cap['hf_output_hidden_states_index']} of a {cap['num_hidden_layers']}-layer model")
            print(f"forwards:   {dict(st['forwards'])}; rows {dict(st['rows'])}; packed aux rows of width "
                  f"{st['last_aux_shape'][1]} (= K x hidden)")
        print()
    finally:
        server.stop()
        shutil.rmtree(os.path.dirname(dump_dir), ignore_errors=True)
    try:
        ok = exact_pass(argv, base, records, log_path.replace(".log", "-fp32.log"))
    except ServerStartError as e:
        print(e)
        return 1
    print("every captured row matches its reference" if ok else "ROWS DIFFER: this is a bug, please report it")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
