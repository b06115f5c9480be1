"""The per-row judge of records from float32 servers against HF transformers float32 (the exact oracle;
tests/e2e/test_exact_rows.py says what the tolerance rests on)."""
TOL = 1e-4


def rel(got, ref):
    """||got - ref|| / ||ref|| per row."""
    return (got.double() - ref.double()).norm(dim=-1) / ref.double().norm(dim=-1)


def assert_exact(rec, hf, want_ids, layers, n_layers, hidden):
    """`rec` holds exactly the rows of `want_ids`; every row of every layer and of the final state is
    within TOL of its own HF row (`hf(ids)`: output_hidden_states) and closer to it than to its
    neighbours (the previous and next token of the same layer, the layers before and after). Returns
    the worst row error."""
    assert rec.input_ids.tolist() == list(want_ids), rec.rid
    T = len(want_ids)
    assert tuple(rec.aux_hidden_states.shape) == (T, len(layers), hidden) and rec.last_hidden_state.shape[0] == T
    hs = hf(want_ids)
    worst = 0.0
    for g, i in [(rec.aux_hidden_states[:, k], lid) for k, lid in enumerate(layers)] + [(rec.last_hidden_state, n_layers)]:
        own = rel(g, hs[i])
        worst = max(worst, own.max().item())
        bad = (own > TOL).nonzero().flatten().tolist()
        assert not bad, (f"{rec.rid}: output_hidden_states[{i}] rows {bad[:12]} of {T} are off by up to "
                         f"{own.max():.3g} (tolerance {TOL})")
        others = {"token t-1": (rel(g[1:], hs[i][:-1]), own[1:]), "token t+1": (rel(g[:-1], hs[i][1:]), own[:-1])}
        for j in (i - 1, i + 1):
            if 0 <= j <= n_layers:
                others[f"layer {j}"] = (rel(g, hs[j]), own)
        for name, (err, mine) in others.items():
            closer = (err <= mine).nonzero().flatten().tolist()
            assert not closer, f"{rec.rid}: output_hidden_states[{i}] rows {closer[:12]} are as close to {name}'s"
    return worst


def prompt_ids(hf, text):
    """BOS + the text's token ids, with `hf.tok`."""
    return [hf.tok.bos_token_id] + hf.tok(text, add_special_tokens=False)["input_ids"]
