"""Long prompts at concurrency (issue 47, item 4): the real CPU server serves four long requests at once with
chunked prefill in small chunks and the radix cache on, then a request whose long prefix the radix cache
serves, and every row of every record is judged against HF transformers float32, row by row, in chunks.

The tiny model's "v3-long" shape (YaRN over 65,536 positions; the shipped one stops at 4,096), float32, both
final states. HF cannot attend over tens of thousands of tokens in one eager pass within memory, so its
reference is computed in chunks of HF_CHUNK tokens through its KV cache (past_key_values), the shared
prefix once (its cache cropped back to it for each continuation), and each record is judged in pieces of
JUDGE_ROWS rows overlapping by one (so every row's neighbours are checked too).

Length: SHARED tokens of shared prefix (SGLANG_HS_TEST_LONG_TOKENS; default 10,240), each request adding
TAIL tokens of its own. On this project's 2-core machine the CPU server prefills ~250 tokens/s at 16K tokens
of context and HF's chunked reference ~160 tokens/s, so 32K-token requests cost minutes each on either side:
the default keeps the module within ~4 minutes (183 s measured); SGLANG_HS_TEST_LONG_TOKENS=32768 runs the same
checks at 32K (passed in 780 s: docs/benchmarks.md#long-records)."""
import concurrent.futures as cf
import os
import random
import types

import pytest

import row_judge
from conftest import States, _serve

pytestmark = pytest.mark.e2e
SHARED = int(os.environ.get("SGLANG_HS_TEST_LONG_TOKENS", "10240"))
TAIL, N, NEW = 384, 4, 4  # each request's own tokens after the shared prefix, requests at once, tokens generated
RADIX_EXTRA = 256  # the radix request shares request 0's prompt up to SHARED + RADIX_EXTRA, then its own TAIL
CHUNK = 256  # --chunked-prefill-size
HF_CHUNK, JUDGE_ROWS = 1024, 2048
LAYERS, N_LAYERS, H, P = [2, 4, 5], 8, 256, 5  # --hs-last both: 3 aux layers, post-norm and pre-norm final states
CONTEXT = SHARED + RADIX_EXTRA + TAIL + NEW + 64
GREEDY = {"max_new_tokens": NEW, "temperature": 0}


def _ids(seed, n):
    rng = random.Random(seed)
    return [rng.randrange(2, 1024) for _ in range(n)]  # no BOS (0) or EOS (1) inside


PREFIX = [0] + _ids(47, SHARED - 1)
TAILS = [_ids(1000 + i, TAIL) for i in range(N)]


@pytest.fixture(scope="module")
def long_server(tmp_path_factory):
    """Float32, --hs-last both, chunks of CHUNK tokens, radix cache and overlap scheduler on; a KV pool, store
    and ring with room for every request of the module at once (no eviction: the radix request's prefix stays)."""
    from sglang_hs.tools import tiny_model

    pool = 2 * (SHARED + (N + 1) * (TAIL + RADIX_EXTRA + NEW))
    ring = (N + 2) * 2 * CONTEXT * P * H * 4 + (64 << 20)  # each request in flight reserves twice its record
    yield from _serve(tmp_path_factory.mktemp("hs-long") / "dump",
                      ["--model-path", tiny_model.ensure("v3-long"), "--dtype", "float32", "--hs-last", "both",
                       "--chunked-prefill-size", str(CHUNK), "--context-length", str(CONTEXT),
                       "--max-total-tokens", str(pool), "--hs-ring-size", str(ring)])


class ChunkedReference:
    """HF transformers float32 of the "v3-long" checkpoint, fed HF_CHUNK tokens at a time through its KV cache:
    output_hidden_states and the final pre-norm state (a hook on the final norm's input) of each token."""

    def __init__(self):
        import torch
        from transformers import AutoModelForCausalLM

        from sglang_hs.tools import tiny_model

        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(tiny_model.ensure("v3-long"), dtype=torch.float32).eval()

    def extend(self, ids, past=None):
        """States of `ids` after the tokens `past` (a KV cache, extended in place) holds; returns (States, past)."""
        torch = self.torch
        parts, pre = [], []
        handle = self.model.model.norm.register_forward_hook(lambda mod, args, out: pre.append(args[0][0].detach()))
        try:
            with torch.no_grad():
                for s in range(0, len(ids), HF_CHUNK):
                    out = self.model(torch.tensor([ids[s:s + HF_CHUNK]]), past_key_values=past, use_cache=True,
                                     output_hidden_states=True)
                    past = out.past_key_values
                    parts.append([h[0] for h in out.hidden_states])
        finally:
            handle.remove()
        states = States(torch.cat([p[i] for p in parts]) for i in range(N_LAYERS + 1))
        states.pre_norm = torch.cat(pre)
        return states, past


def _crop(past, n):
    """Keep the first `n` tokens of KV cache `past`."""
    extra = past.get_seq_length() - n
    if extra > 0:
        past.crop(-extra)


def _joined(a, b):
    import torch

    out = States(torch.cat([x, y]) for x, y in zip(a, b))
    out.pre_norm = torch.cat([a.pre_norm, b.pre_norm])
    return out


def judge_in_pieces(rec, want_ids, ref):
    """Every row of `rec` against `ref` (States of want_ids), JUDGE_ROWS rows at a time, each piece overlapping
    the one before by a row (row_judge.assert_exact: each row within TOL of its own HF row and closer to it than
    to its neighbours). Returns the worst row error."""
    assert rec.input_ids.tolist() == list(want_ids), rec.rid
    T, worst = len(want_ids), 0.0
    for s in range(0, T, JUDGE_ROWS):
        a, b = max(0, s - 1), min(T, s + JUDGE_ROWS)
        piece = types.SimpleNamespace(
            rid=f"{rec.rid}[{a}:{b}]", input_ids=rec.input_ids[a:b], aux_hidden_states=rec.aux_hidden_states[a:b],
            last_hidden_state=rec.last_hidden_state[a:b], last_pre_norm=rec.last_pre_norm[a:b])
        part = States(x[a:b] for x in ref)
        part.pre_norm = ref.pre_norm[a:b]
        worst = max(worst, row_judge.assert_exact(piece, lambda ids: part, want_ids[a:b], LAYERS, N_LAYERS, H))
    return worst


def test_four_long_requests_at_once_then_a_radix_hit_every_row_exact(long_server):
    """N requests of SHARED + TAIL tokens sent at once (chunked in CHUNK-token steps, their records gathered and
    published while the others run), then one sharing request 0's first SHARED + RADIX_EXTRA tokens, which the
    radix cache serves (cached_tokens); each record holds every row of its prompt and generated tokens but the
    last, each within TOL of HF float32."""
    from sglang_hs import HiddenStateReader

    server = long_server
    prompts = [PREFIX + t for t in TAILS]
    with cf.ThreadPoolExecutor(N) as pool:
        outs = list(pool.map(lambda i: server.generate(input_ids=prompts[i], rid=f"long-{i}", sampling_params=GREEDY),
                             range(N)))
    radix_prompt = prompts[0][:SHARED + RADIX_EXTRA] + _ids(2000, TAIL)
    radix_out = server.generate(input_ids=radix_prompt, rid="long-radix", sampling_params=GREEDY)
    assert radix_out["meta_info"]["cached_tokens"] >= SHARED + RADIX_EXTRA, radix_out["meta_info"]
    reader = HiddenStateReader(str(server.dump))
    try:
        assert reader.manifest["dtype"] == "float32" and reader.manifest["rows_per_token"] == P
        records = {rid: reader.take(rid, timeout=120) for rid in [f"long-{i}" for i in range(N)] + ["long-radix"]}
    finally:
        reader.close()

    hf = ChunkedReference()
    shared, past = hf.extend(PREFIX)
    worst = 0.0
    for i, out in enumerate(outs):
        want = (prompts[i] + out["output_ids"])[:-1]
        tail, past = hf.extend(want[SHARED:], past)
        if i == 0:  # the radix request continues request 0's first SHARED + RADIX_EXTRA tokens
            _crop(past, SHARED + RADIX_EXTRA)
            radix_want = (radix_prompt + radix_out["output_ids"])[:-1]
            radix_tail, _ = hf.extend(radix_want[SHARED + RADIX_EXTRA:], past)
            head = States(x[:RADIX_EXTRA] for x in tail)
            head.pre_norm = tail.pre_norm[:RADIX_EXTRA]
            worst = max(worst, judge_in_pieces(records.pop("long-radix"), radix_want,
                                               _joined(_joined(shared, head), radix_tail)))
        _crop(past, SHARED)
        worst = max(worst, judge_in_pieces(records.pop(f"long-{i}"), want, _joined(shared, tail)))
    print(f"{N} records of {SHARED + TAIL}+ rows and a radix hit of {radix_out['meta_info']['cached_tokens']} "
          f"tokens: every row within {worst:.2e} of HF float32")
