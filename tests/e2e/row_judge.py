"""The per-row judge of records from float32 servers against HF transformers float32 (the exact oracle;
tests/e2e/test_exact_rows.py says what the tolerance rests on)."""
import concurrent.futures as cf
from collections import namedtuple

TOL = 1e-4
# rows stored in bf16 (--format specforge files, whatever the server's dtype): one rounding of a float32 row,
# at most 2^-9 relative per element, so within BF16_TOL of HF float32 per row; a neighbour is ~1 off
BF16_TOL = 4e-3


# a record's rows put together from the chunks a reader with part_bytes handed out: what assert_exact judges
Whole = namedtuple("Whole", "rid input_ids aux_hidden_states last_hidden_state last_pre_norm")


def rel(got, ref):
    """||got - ref|| / ||ref|| per row."""
    return (got.double() - ref.double()).norm(dim=-1) / ref.double().norm(dim=-1)


def assert_exact(rec, hf, want_ids, layers, n_layers, hidden, tol=TOL):
    """`rec` holds exactly the rows of `want_ids`; every row of every layer and of the final state is
    within TOL of its own HF row (`hf(ids)`: output_hidden_states) and closer to it than to its
    neighbours (the previous and next token of the same layer, the layers before and after). Returns
    the worst row error."""
    assert rec.input_ids.tolist() == list(want_ids), rec.rid
    T = len(want_ids)
    assert tuple(rec.aux_hidden_states.shape) == (T, len(layers), hidden)
    assert all(x is None or tuple(x.shape) == (T, hidden) for x in (rec.last_hidden_state, rec.last_pre_norm))
    hs = hf(want_ids)
    worst = 0.0
    if rec.last_pre_norm is not None:  # --hs-last pre-norm/both: judged on its own below
        worst = assert_pre_norm(rec, hs, n_layers)
    if rec.last_hidden_state is None:
        assert rec.last_pre_norm is not None, rec.rid
    for g, i in [(rec.aux_hidden_states[:, k], lid) for k, lid in enumerate(layers)] + \
            ([(rec.last_hidden_state, n_layers)] if rec.last_hidden_state is not None else []):
        own = rel(g, hs[i])
        worst = max(worst, own.max().item())
        bad = (own > tol).nonzero().flatten().tolist()
        assert not bad, (f"{rec.rid}: output_hidden_states[{i}] rows {bad[:12]} of {T} are off by up to "
                         f"{own.max():.3g} (tolerance {tol})")
        others = {"token t-1": (rel(g[1:], hs[i][:-1]), own[1:]), "token t+1": (rel(g[:-1], hs[i][1:]), own[:-1])}
        for j in (i - 1, i + 1):
            if 0 <= j <= n_layers:
                others[f"layer {j}"] = (rel(g, hs[j]), own)
        for name, (err, mine) in others.items():
            closer = (err <= mine).nonzero().flatten().tolist()
            assert not closer, f"{rec.rid}: output_hidden_states[{i}] rows {closer[:12]} are as close to {name}'s"
    return worst


def assert_pre_norm(rec, hs, n_layers):
    """Every row of the final pre-norm state within TOL of HF's (the input of model.model.norm, `hs.pre_norm`)
    and closer to it than to the post-norm state (a norm applied, or applied twice), to the last layer's
    input (output_hidden_states[n-1]) and to the previous and next token's rows. Returns the worst error."""
    g, ref = rec.last_pre_norm, hs.pre_norm
    own = rel(g, ref)
    bad = (own > TOL).nonzero().flatten().tolist()
    assert not bad, f"{rec.rid}: pre-norm final state rows {bad[:12]} of {len(ref)} are off by up to {own.max():.3g}"
    others = {"the post-norm state": (rel(g, hs[n_layers]), own), f"layer {n_layers - 1}": (rel(g, hs[n_layers - 1]), own),
              "token t-1": (rel(g[1:], ref[:-1]), own[1:]), "token t+1": (rel(g[:-1], ref[1:]), own[:-1])}
    for name, (err, mine) in others.items():
        closer = (err <= mine).nonzero().flatten().tolist()
        assert not closer, f"{rec.rid}: pre-norm final state rows {closer[:12]} are as close to {name}'s"
    return own.max().item()


def prompt_ids(hf, text):
    """BOS + the text's token ids, with `hf.tok`."""
    return [hf.tok.bos_token_id] + hf.tok(text, add_special_tokens=False)["input_ids"]


# Prompts besides a test's long text for concurrent_records: its requests cycle through [long, *MIXED_TEXTS].
MIXED_TEXTS = ("The scheduler groups requests into batches. A long prompt is cut into chunks so that",
               "Shared memory lets one process write and another read without copying through the kernel.")


def concurrent_records(server, reader, hf, texts, rid_prefix, n, prompt_len, new_tokens, judge, timeout=60):
    """`n` greedy requests sent at once, request i: the first prompt_len(i) tokens of texts[i % len(texts)]
    (BOS included), new_tokens(i) generated, rid f"{rid_prefix}-{i}"; each record judged with
    judge(rec, hf, want_ids) on the prompt and every generated token but the last. Returns the worst error."""
    jobs = [(f"{rid_prefix}-{i}", prompt_ids(hf, texts[i % len(texts)])[:prompt_len(i)], new_tokens(i))
            for i in range(n)]
    with cf.ThreadPoolExecutor(n) as pool:
        outs = list(pool.map(lambda j: server.generate(
            input_ids=j[1], rid=j[0], sampling_params={"max_new_tokens": j[2], "temperature": 0}), jobs))
    return max(judge(reader.take(rid, timeout=timeout), hf, (ids + out["output_ids"])[:-1])
               for (rid, ids, _), out in zip(jobs, outs))


def radix_requests(server, hf, long_text, rid_prefix, repeat=False):
    """Requests whose rows the server takes from its prefix cache, sent one after another (5 greedy tokens
    each): a and b sharing the first 32 tokens of `long_text`, with `repeat` a again, then a follow-up
    turn of a (its prompt, reply and a question) whose cached prefix holds rows of a's decode steps. Checks
    the cache served them (cached_tokens); returns [(rid, prompt ids, reply)] as sent, rids
    f"{rid_prefix}-a", -b, -a-again, -turn."""
    prefix = prompt_ids(hf, long_text)[:32]
    a = prefix + prompt_ids(hf, " first ending about batches")[1:]
    b = prefix + prompt_ids(hf, " a different ending entirely, longer than the first one")[1:]
    sent = []

    def send(name, ids):
        out = server.generate(input_ids=ids, rid=f"{rid_prefix}-{name}",
                              sampling_params={"max_new_tokens": 5, "temperature": 0})
        sent.append((f"{rid_prefix}-{name}", ids, out))
        return out

    out_a, out_b = send("a", a), send("b", b)
    out_a2 = send("a-again", a) if repeat else None
    turn = a + out_a["output_ids"] + prompt_ids(hf, " and then a question")[1:]
    out_t = send("turn", turn)
    assert out_b["meta_info"]["cached_tokens"] >= 30, out_b["meta_info"]
    assert out_a2 is None or out_a2["meta_info"]["cached_tokens"] >= len(a) - 1, out_a2["meta_info"]
    assert out_t["meta_info"]["cached_tokens"] > len(a), out_t["meta_info"]  # generated rows from the cache
    return sent
