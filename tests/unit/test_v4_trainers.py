"""SpecForge 0.2.0 and speculators 0.9.0 train on files extracted from a DeepSeek-V4 dump (issue 34, item 4).

The same path runs end to end on a real V4 server in tests/e2e/test_v4_cpu.py (the csa-dp2 server's records: the
extraction CLI's files of both formats, both trainers' teachers against HF and their loss falling). This unit test
keeps a faster, server-free check on another checkpoint (6 layers, CSA's index settings, LAYERS [1, 3, 5]) and the
--from-dump extraction: the dump is written as the V4 overlay writes it
(sglang_hs/server/models/deepseek_v4.py): the real CaptureWriter with the overlay's CaptureSpec (hc_mult 4, the
default `--hs-hc-streams mean`, `--hs-last both`), rows handed to `writer.copy` through `spec.pack` as the
overlay's forward does, records published from their KV slots. The rows are HF transformers float32's own
for a tiny DeepseekV4ForCausalLM checkpoint (saved at test time, random norm weights): the streams' mean
entering each layer id (HF `output_hidden_states[i].mean(-2)`), the post-norm final state
(`output_hidden_states[n]`) and the pre-norm one (the input of `model.model.norm`, after the head's
collapse). The extraction CLI (`--from-dump`) writes both formats; each trainer's released reader loads them,
its teacher (SpecForge's TargetHead on the post-norm state, speculators' verifier norm + lm_head on the
pre-norm one) gives HF's logits row by row within bf16 precision, and one optimizer step of each trainer's
own code runs on them with a finite loss. Full streams are refused for these formats: test_v4_outputs.py."""
import json
import os
import shutil

import pytest
import torch

from sglang_hs._ext import ExtensionNotBuilt, ext

try:
    ext()
except ExtensionNotBuilt as e:  # pragma: no cover
    pytest.skip(f"extension not built: {e}", allow_module_level=True)

from helpers import specforge_losses  # noqa: E402
from reference import hc_rows_ref  # noqa: E402
from sglang_hs.tools import tiny_model  # noqa: E402
from sglang_hs.server.capture_spec import CaptureSpec, hc_mult_of  # noqa: E402
from sglang_hs.extract import checkpoint_names, cli, output  # noqa: E402
from sglang_hs.server.store.writer import CaptureWriter  # noqa: E402
from test_trainer_teachers import BF16_ROW_TOL, _readers, rel  # noqa: E402

LAYERS, SLOTS = [1, 3, 5], 256


@pytest.fixture(scope="module")
def v4(tmp_path_factory):
    """A tiny V4 checkpoint, HF float32's rows and logits for three sequences, and a dump of them."""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    from sglang_hs.tools import tiny_model

    root = tmp_path_factory.mktemp("v4")
    torch.manual_seed(0)
    cfg = DeepseekV4Config(vocab_size=tiny_model.config()["vocab_size"], hidden_size=88, moe_intermediate_size=40, num_hidden_layers=6,
                           num_attention_heads=4, num_key_value_heads=1, head_dim=64, q_lora_rank=24,
                           num_experts_per_tok=2, n_routed_experts=6, n_shared_experts=1, hc_mult=4, o_groups=2,
                           o_lora_rank=24, index_n_heads=2, index_head_dim=32, index_topk=4, sliding_window=8,
                           num_nextn_predict_layers=0, max_position_embeddings=512)
    model = DeepseekV4ForCausalLM(cfg).float().eval()
    tiny_model.randomise_norms(model, seed=1)
    ckpt = str(root / "ckpt")
    model.save_pretrained(ckpt, safe_serialization=True, max_shard_size="2MB")  # SpecForge reads an index.json
    for name in ("tokenizer.json", "tokenizer_config.json"):  # speculators loads the verifier's tokenizer
        shutil.copy(os.path.join(tiny_model.ensure(), name), os.path.join(ckpt, name))
    g = torch.Generator().manual_seed(7)
    rows = []
    for T in (9, 23, 31):
        ids = torch.randint(2, cfg.vocab_size, (T,), generator=g)
        taken = []
        h = model.model.norm.register_forward_hook(lambda mod, args, o: taken.append(args[0][0].detach()))
        with torch.no_grad():
            r = model(ids[None], output_hidden_states=True)
        h.remove()
        states = [s[0] for s in r.hidden_states]
        rows.append({"ids": ids, "prompt_len": T // 3, "aux": hc_rows_ref(states, LAYERS, "mean"),
                     "post": states[-1], "pre": taken[0], "logits": r.logits[0], "states": states})
    assert rows[0]["states"][1].shape == (9, 4, 88) and rows[0]["pre"].shape == (9, 88)

    # the V4 overlay's writer: its spec (hc_mult from the config, the default stream mean, --hs-last both)
    dump = root / "dump"
    dump.mkdir(mode=0o700)
    spec = CaptureSpec.resolve(LAYERS, "both", cfg.num_hidden_layers, cfg.hidden_size, hc_mult=hc_mult_of(cfg))
    w = CaptureWriter(str(dump), spec, SLOTS, torch.float32, 1 << 20, model_path=ckpt,
                      architecture="DeepseekV4ForCausalLM")
    slot = 1  # slot 0 is SGLang's padding slot
    for r in rows:
        T = len(r["ids"])
        r["loc"] = torch.arange(slot, slot + T)
        aux, last = spec.pack(r["aux"].reshape(T, -1), r["post"], r["pre"])  # as the overlay's forward
        w.copy(aux, last, r["loc"])
        slot += T
    return {"ckpt": ckpt, "rows": rows, "dump": dump, "writer": w, "root": root}


def _extract(v4, fmt):
    """The extraction of the dump's records into `fmt` (each format's run gets the records published anew:
    a harvest acknowledges what it reads)."""
    out = v4["root"] / fmt
    if not out.exists():
        for i, r in enumerate(v4["rows"]):  # the records of finished requests: every token but the last
            v4["writer"].publish_gathered(f"{fmt}-{i}", r["ids"][:-1].int(), r["loc"][:-1],
                                          prompt_len=r["prompt_len"], next_token=int(r["ids"][-1]))
        assert cli.main(["--from-dump", str(v4["dump"]), "--output", str(out), "--format", fmt,
                         "--save-dtype", "bf16", "--idle-timeout", "0.5"]) == 0
    return out, json.load(open(out / "manifest.json"))


def _row(r):
    """The record's rows of a sample: every token but the last (the record ends before the last token)."""
    T = len(r["ids"]) - 1
    return {k: r[k][:T] for k in ("ids", "aux", "post", "pre", "logits")}, T


def test_the_extraction_records_the_v4_convention(v4):
    _, m = _extract(v4, "specforge")
    print({k: m[k] for k in ("hc_mult", "hc_streams", "rows_per_layer", "dspark_layer_ids", "draft_model_config")})
    assert (m["hc_mult"], m["hc_streams"], m["rows_per_layer"]) == (4, "mean", 1) and m["samples_written"] == 3
    assert m["dspark_layer_ids"] == [0, 2, 4] == m["draft_model_config"]["dspark_target_layer_ids"]
    assert m["draft_model_config"]["eagle_config"]["eagle_aux_hidden_state_layer_ids"] is None  # no EAGLE-3 in SGLang for V4
    assert m["draft_model_config"]["target_hidden_size"] == 88


def test_specforge_reads_v4_files_and_its_target_head_gives_hfs_logits(v4):
    _readers()
    from specforge.data.preprocessing import build_offline_eagle3_dataset
    from specforge.modeling.target.target_head import TargetHead

    out, _ = _extract(v4, "specforge")
    ds = build_offline_eagle3_dataset(str(out), max_len=4096)
    assert len(ds) == 3
    run = json.load(open(out / output.SPECFORGE_CONFIG))
    assert run["model"]["lm_head_key"] == "head.weight"  # V4's name for it; SpecForge's default is lm_head.weight
    head = TargetHead.from_pretrained(v4["ckpt"], lm_head_key=run["model"]["lm_head_key"])
    for j in range(len(ds)):
        path = ds.datapaths[j]
        i = [k for k, r in enumerate(v4["rows"]) if torch.equal(torch.load(path)["input_ids"], r["ids"][:-1])][0]
        want, T = _row(v4["rows"][i])
        item = ds[j]
        print(i, {k: (tuple(x.shape), x.dtype) for k, x in item.items()})
        assert torch.equal(item["input_ids"][0], want["ids"])
        assert torch.equal(item["hidden_state"][0], want["aux"].reshape(T, -1).bfloat16())  # [1, T, 3 * 88]
        assert torch.equal(item["target"][0], want["post"].bfloat16())
        with torch.no_grad():
            logits = head(item["target"])[0]
        err = rel(logits, want["logits"])
        print(f"SpecForge sample {i}: logits off by at most {err.max().item():.4f}")
        assert (err < BF16_ROW_TOL).all(), err


def test_speculators_reads_v4_files_and_its_teacher_gives_hfs_logits_and_trains(v4):
    """speculators' ArrowDataset and CollateFn, its draft built from the printed command's TrainConfig with
    the V4 checkpoint as verifier, its teacher against HF's logits, then one optimizer step of its own
    Eagle3 draft (as tests/unit/test_trainer_teachers.py does for V3)."""
    _readers()
    try:
        from speculators.models.eagle3 import Eagle3DraftModel
        from speculators.train.cli import build_draft_model
        from speculators.train.config import TrainConfig
        from speculators.train.data import ArrowDataset, CollateFn
    except ImportError as e:
        pytest.skip(f"speculators' trainer does not import: {e}")
    import argparse

    out, m = _extract(v4, "safetensors")
    assert m["speculators_dataset_rows"] == 3
    argv = m["train_command"][2:]
    # speculators would take V4's embedding as its lm_head (it finds no lm_head.weight in head.weight's checkpoint:
    # its teacher was 1.4 off HF's logits, relative L2): the printed command names a verifier with them renamed
    verifier = argv[argv.index("--verifier-name-or-path") + 1]
    assert verifier == str(out / checkpoint_names.SPECULATORS_VERIFIER)
    from safetensors.torch import load_file

    shim = load_file(os.path.join(verifier, "model.safetensors"))
    index = json.load(open(os.path.join(v4["ckpt"], "model.safetensors.index.json")))["weight_map"]
    ckpt = {k: load_file(os.path.join(v4["ckpt"], index[k]))[k] for k in ("head.weight", "model.norm.weight")}
    assert torch.equal(shim["lm_head.weight"], ckpt["head.weight"])
    assert torch.equal(shim["model.norm.weight"], ckpt["model.norm.weight"])
    assert argv[argv.index("--target-layer-ids") + 1:][:3] == ["1", "3", "5"]
    cfg = TrainConfig.resolve(argv + ["--draft-attn-impl", "sdpa", "--loss-implementation", "eager"])
    args = argparse.Namespace(**cfg.flatten())
    model = build_draft_model(args, Eagle3DraftModel, None, None, tiny_model.config()["vocab_size"])
    model.load_verifier_weights()
    assert model.target_layer_ids == LAYERS
    ds = ArrowDataset(4096, str(out), on_missing="raise")
    items = []
    for row in range(len(ds)):
        item = ds[row]
        i = [k for k, r in enumerate(v4["rows"]) if torch.equal(item["input_ids"], r["ids"][:-1])][0]
        want, T = _row(v4["rows"][i])
        assert torch.equal(item["hidden_states"], want["aux"].reshape(T, -1).bfloat16())
        assert torch.equal(item["verifier_last_hidden_states"], want["pre"].bfloat16())
        with torch.no_grad():  # speculators/models/eagle3/core.py's targets
            logits = model.verifier_lm_head(model.verifier_norm(item["verifier_last_hidden_states"].float()))
        err = rel(logits, want["logits"])
        print(f"speculators sample {i}: logits off by at most {err.max().item():.4f}")
        assert (err < BF16_ROW_TOL).all(), err
        items.append(item)
    train_kwargs, _ = Eagle3DraftModel.get_trainer_kwargs(**vars(args))
    batch = CollateFn(sum(len(x["input_ids"]) for x in items), 88, len(LAYERS), dtype=torch.bfloat16)(items)
    assert batch["error_records"] == 0
    torch.manual_seed(0)
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, loss, _ = model(**batch, **train_kwargs)
    opt.zero_grad()
    loss.backward()
    opt.step()
    print("speculators loss on V4 files", loss.item())
    assert torch.isfinite(loss)


def test_specforge_trains_a_step_on_v4_files(v4):
    """SpecForge's own offline EAGLE-3 step (helpers.specforge_losses: its run config, draft
    config resolved from the V4 target, TargetHead, forward_loss, AdamW) on the extracted files."""
    _readers()
    out, m = _extract(v4, "specforge")
    run = json.load(open(out / output.SPECFORGE_CONFIG))
    assert run["model"]["target_model_path"] == v4["ckpt"] and run["data"]["hidden_states_path"] == str(out)
    losses = specforge_losses(out / output.SPECFORGE_CONFIG)
    print("SpecForge losses per epoch on V4 files", losses)
    assert all(torch.isfinite(torch.tensor(losses))), losses
