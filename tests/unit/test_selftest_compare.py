"""The self-test's verdict logic (sglang_hs/selftest.py): it passes equal captures and fails the faults it
exists to catch: rows shifted by one position, another layer's rows, differing token ids or counts,
and noise beyond bf16 tolerance. (tests/e2e/test_selftest.py runs the whole self-test on the server.)"""
import torch

from sglang_hs.selftest import Capture, compare, make_prompts


def _captures(seed=0, n=3, T=20, K=3, H=64):
    g = torch.Generator().manual_seed(seed)
    return [Capture(list(range(5, 5 + T + i)), torch.randn(T + i, K, H, generator=g), torch.randn(T + i, H, generator=g))
            for i in range(n)]


def _map(caps, fn_aux, fn_last=lambda x: x, ids=lambda x: x):
    return [Capture(ids(c.token_ids), fn_aux(c.aux), fn_last(c.last)) for c in caps]


def test_equal_and_bf16_rounded_captures_pass():
    ref = _captures()
    assert compare(ref, ref)[0]
    ok, row = compare(_map(ref, lambda a: a.bfloat16(), lambda x: x.bfloat16()), ref)
    assert ok and row["median"] < 0.01 and row["rows"] == 20 + 21 + 22


def test_off_by_one_rows_fail():
    ref = _captures()
    shifted = _map(ref, lambda a: torch.cat([a[:1], a[:-1]]))
    assert not compare(shifted, ref)[0]


def test_another_layers_rows_fail():
    ref = _captures()
    assert not compare(_map(ref, lambda a: a.roll(1, dims=1)), ref)[0]


def test_noise_beyond_tolerance_fails_and_a_few_far_rows_do_not():
    ref = _captures()
    noisy = _map(ref, lambda a: a + 0.1 * torch.randn_like(a))
    assert not compare(noisy, ref)[0]

    def one_row_off(a):  # a routing near-tie: one token far off, the rest exact
        a = a.clone()
        a[3] += 1.0
        return a

    assert compare(_map(ref, one_row_off), ref)[0]


def test_different_token_ids_or_counts_fail():
    ref = _captures()
    assert not compare(_map(ref, lambda a: a, ids=lambda t: t[:-1] + [t[-1] + 1]), ref)[0]
    assert not compare(_map(ref, lambda a: a[:-1], lambda x: x[:-1]), ref)[0]


def test_prompts_cover_shared_prefixes_and_a_repeat_within_the_vocabulary():
    p = make_prompts(1000)
    assert p[4][:30] == p[3][:30] == p[5][:30] and p[6] == p[2]
    assert all(5 <= t < 1000 for q in p for t in q)
