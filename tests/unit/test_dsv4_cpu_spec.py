"""dsv4_cpu_spec (DeepSeek-V4's verify pass on the CPU engine): a chain of drafts is each request's span (seq_len,
draft_token_num), causal as a prefill chunk, under either mask layout SGLang's CPU workers produce; a tree is refused;
other modes keep dsv4_torch_native's spans; set_embed_and_head rebinds without CUDA calls on a CPU tensor. The
end-to-end judge (every verify row against HF float32, drafts accepted and rejected over closing CSA/HCA blocks) is
tests/e2e/test_v4_cpu.py::test_speculative_verify_passes_over_the_compressed_blocks.
"""
import types

import pytest
import torch


@pytest.fixture(scope="module")
def spec(cpu_engine_imports):
    with cpu_engine_imports():
        from sglang_hs.server.patches import dsv4_cpu_spec
    return dsv4_cpu_spec


class _Mode:
    def __init__(self, verify):
        self.verify = verify

    def is_target_verify(self):
        return self.verify

    def is_idle(self):
        return False

    def is_decode(self):
        return False


def _batch(seq_lens, reqs, n, mask):
    return types.SimpleNamespace(forward_mode=_Mode(True), seq_lens_cpu=torch.tensor(seq_lens),
                                 req_pool_indices=torch.tensor(reqs),
                                 spec_info=types.SimpleNamespace(draft_token_num=n, custom_mask=mask))


def _chain(n):
    return torch.ones((n, n), dtype=torch.bool).tril()


@pytest.mark.parametrize("layout", ["qlen", "full", "none"])
def test_a_chain_is_each_requests_span(spec, layout):
    seq_lens, reqs, n = [7, 130], [3, 1], 3
    if layout == "qlen":
        mask = torch.cat([_chain(n).flatten()] * 2)
    elif layout == "full":
        mask = torch.cat([torch.cat([torch.ones((n, p), dtype=torch.bool), _chain(n)], 1).flatten() for p in seq_lens])
    else:
        mask = None
    assert spec.verify_spans(_batch(seq_lens, reqs, n, mask)) == [(3, 7, 3), (1, 130, 3)]


@pytest.mark.parametrize("broken", ["tree", "prefix hidden"])
def test_a_tree_is_refused(spec, broken):
    n, p = 3, 5
    tree = _chain(n)
    if broken == "tree":
        tree[2, 1] = False  # draft 2 a sibling of draft 1, not its child
        mask = torch.cat([torch.ones((n, p), dtype=torch.bool), tree], 1).flatten()
    else:
        prefix = torch.ones((n, p), dtype=torch.bool)
        prefix[1, 0] = False
        mask = torch.cat([prefix, tree], 1).flatten()
    with pytest.raises(NotImplementedError, match="draft tree"):
        spec.verify_spans(_batch([p], [0], n, mask))


def test_other_modes_keep_their_spans(spec):
    seen = []
    wrapped = spec._with_verify(lambda fb: seen.append(fb) or "theirs")
    other = types.SimpleNamespace(forward_mode=_Mode(False))
    assert wrapped(other) == "theirs" and seen == [other]
    assert wrapped(_batch([4], [2], 2, None)) == [(2, 4, 2)] and len(seen) == 1


def test_set_embed_and_head_on_cpu(spec, cpu_engine_imports):
    with cpu_engine_imports():
        from sglang_hs.server.patches.eagle_cpu_draft import _cpu_safe
    calls = []
    model = types.SimpleNamespace(model=types.SimpleNamespace(embed_tokens=torch.nn.Linear(2, 2, bias=False)),
                                  lm_head=torch.nn.Linear(2, 2, bias=False))
    embed, head = torch.nn.Parameter(torch.ones(2, 2)), torch.nn.Parameter(torch.zeros(2, 2))
    _cpu_safe(lambda *a: calls.append(a))(model, embed, head)
    assert not calls and model.model.embed_tokens.weight is embed and model.lm_head.weight is head


def test_a_draft_decode_step_is_one_token_at_its_position(spec):
    """The MTP draft's step i (--speculative-num-steps > 1, top-k 1): each request's token at its position (seq_len +
    i, as EagleWorkerV2.draft_forward advances it), its keys req_to_token[req, :position + 1]; a target's decode
    (no spec_info) keeps dsv4_torch_native's spans; a tree's rows (top-k per request) are refused."""
    class Decode(_Mode):
        def is_decode(self):
            return True

    step = types.SimpleNamespace(forward_mode=Decode(False), req_pool_indices=torch.tensor([4, 2]),
                                 positions=torch.tensor([11, 30]), seq_lens_cpu=torch.tensor([10, 29]),
                                 spec_info=object())
    wrapped = spec._with_verify(lambda fb: "theirs")
    assert wrapped(step) == [(4, 11, 1), (2, 30, 1)]
    assert wrapped(types.SimpleNamespace(**dict(vars(step), spec_info=None))) == "theirs"
    with pytest.raises(NotImplementedError, match="draft tree"):
        spec.draft_decode_spans(types.SimpleNamespace(**dict(vars(step), positions=torch.tensor([11, 11, 30, 30]))))
