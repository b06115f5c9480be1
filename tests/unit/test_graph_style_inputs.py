"""Graph-style inputs through the overlay's forward on the CPU: the batches SGLang's graph runners build
(padded up to a batch-size bucket, padding rows aimed at the padding slot 0, no request ids, a capture
pass of pure padding, `out_cache_loc_virtual` shorter than the padded rows) go through the real overlay
forward, the real writer (C++ copy into a store in shared memory) and finish-time gather, and no padded
row ever reaches a record. The inner model is a stand-in whose rows are a known function of (token,
position), so every record row can be checked exactly."""
import contextlib
from types import SimpleNamespace

import pytest
import torch

from sglang_hs.server.capture_spec import CaptureSpec
from sglang_hs.reader import HiddenStateReader

H, LAYERS, N_LAYERS, VOCAB, MAX_POS = 32, [1, 3], 4, 50, 16
SPEC = CaptureSpec.resolve(LAYERS, True, N_LAYERS, H)
P = len(LAYERS) + 1
TABLE = torch.randn(VOCAB, MAX_POS, P, H, generator=torch.Generator().manual_seed(0)).bfloat16()
GARBAGE = 8192.0  # what padding rows carry: far from every real row, exact in bf16


class StandInModel:
    """Returns (hidden, aux) like the overlay's inner model: rows of TABLE for real tokens, GARBAGE for
    padding rows (token id 0 here, as graph runners zero their input buffers)."""

    def __call__(self, input_ids, positions, forward_batch, *args):
        rows = TABLE[input_ids.clamp(0, VOCAB - 1), positions.clamp(0, MAX_POS - 1)].clone()
        rows[input_ids == 0] = GARBAGE
        return rows[:, -1], rows[:, :-1].reshape(len(input_ids), -1)


class Mode:
    def __init__(self, name):
        self.name = name


def _batch(mode, loc, rids=None, virtual=None):
    return SimpleNamespace(forward_mode=Mode(mode), out_cache_loc=torch.tensor(loc), rids=rids,
                           out_cache_loc_virtual=None if virtual is None else torch.tensor(virtual))


@pytest.fixture(params=["direct", "staging"])
def overlay(overlay_module, tmp_path, monkeypatch, request):
    from sglang_hs.server.store.writer import CaptureWriter

    monkeypatch.setattr(overlay_module.upstream, "get_attn_tp_context", lambda: SimpleNamespace(
        maybe_input_scattered=lambda fb: contextlib.nullcontext()))
    model = object.__new__(overlay_module.DeepseekV3ForCausalLM)  # no SGLang runtime: what forward uses
    object.__setattr__(model, "__dict__", {})
    torch.nn.Module.__init__(model)
    model.model = StandInModel()
    model.hs_spec, model._hs_hang_in_warmup = SPEC, False
    model.hs_status = SimpleNamespace(saw_aux=lambda *a: None)
    # staging: 4 rows, so the 8-row prefill is shipped in two chunks and a 4-row graph just fits
    model.hs_writer = CaptureWriter(str(tmp_path), SPEC, num_slots=64, dtype=torch.bfloat16, ring_bytes=1 << 20,
                                    copy=request.param, staging_rows=4)
    model.logits_processor = lambda ids, hidden, head, fb, aux: (hidden, aux)
    model.lm_head = None
    return model


def _forward(model, ids, pos, fb, replay_rows=None):
    """One ModelRunner step. replay_rows=n: a CUDA-graph replay with n real rows, which runs none of the
    overlay's Python: the staging strategy's forward then only writes its stage (as when it was
    captured), and the step hook after it ships the n rows."""
    w = model.hs_writer
    w.before_step()
    if replay_rows is not None and w.staging is not None:
        w.staging._capturing = lambda: True
    try:
        out = model.forward(torch.tensor(ids), torch.tensor(pos), fb)
    finally:
        if w.staging is not None:
            w.staging.__dict__.pop("_capturing", None)
    w.after_step(len(fb.out_cache_loc) if replay_rows is None else replay_rows, replay_rows is not None)
    return out


def test_padded_ridless_batches_never_reach_a_record(overlay, tmp_path):
    A, B = [7, 8, 9, 10, 11], [20, 21, 22]
    a_slots, b_slots = [3, 4, 5, 6, 7], [10, 11, 12]
    # Graph capture and warm-up: a bucket of pure padding, no request ids.
    _forward(overlay, [0] * 4, [0] * 4, _batch("DECODE", [0] * 4))
    # Prefill of both requests (eager), then decode steps replayed from a bs=4 graph: 2 real rows + 2 padding.
    _forward(overlay, A + B, list(range(5)) + list(range(3)), _batch("EXTEND", a_slots + b_slots, rids=["A", "B"]))
    a_slots.append(8), b_slots.append(13)
    _forward(overlay, [30, 31, 0, 0], [5, 3, 0, 0], _batch("DECODE", [8, 13, 0, 0]), replay_rows=2)
    # A step whose kernel padding rows are cut by out_cache_loc_virtual (3 real rows of 4 forwarded).
    a_slots.append(9), b_slots.append(14)
    _forward(overlay, [32, 33, 0, 0], [6, 4, 0, 0], _batch("DECODE", [9, 14, 0, 0], virtual=[9, 14]), replay_rows=2)
    overlay.hs_writer.finish("A", A + [30, 32], torch.tensor(a_slots))
    overlay.hs_writer.finish("B", B + [31, 33], torch.tensor(b_slots))

    reader = HiddenStateReader(str(tmp_path), wait=1)
    for rid, ids in (("A", A + [30, 32]), ("B", B + [31, 33])):
        rec = reader.take(rid, timeout=5)
        want = TABLE[torch.tensor(ids), torch.arange(len(ids))]
        assert rec.input_ids.tolist() == ids
        assert torch.equal(rec.aux_hidden_states, want[:, :-1]) and torch.equal(rec.last_hidden_state, want[:, -1])
        assert (rec.aux_hidden_states.float().abs() < GARBAGE / 2).all()
    assert reader.poll() == 0  # nothing else was published: padding and warm-up never make records
    # The padding slot holds garbage, and no real slot does.
    store = overlay.hs_writer.store
    assert (store[0].float() == GARBAGE).all()
    assert (store[a_slots + b_slots].float().abs() < GARBAGE / 2).all()


def test_a_count_mismatch_is_refused_not_published(overlay, tmp_path):
    _forward(overlay, [7, 8, 9], [0, 1, 2], _batch("EXTEND", [3, 4, 5], rids=["C"]))
    with pytest.raises(RuntimeError, match="2 KV slots for 3 forwarded tokens"):
        overlay.hs_writer.finish("C", [7, 8, 9], torch.tensor([3, 4]))
    assert HiddenStateReader(str(tmp_path), wait=1).poll() == 0
