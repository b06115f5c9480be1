"""Each trainer's teacher, computed by the trainer's own code on files our sinks write, equals HF's logits.

SpecForge 0.2.0 applies its `TargetHead` (lm_head only) to the file's final state; speculators 0.9.0 computes
`verifier_lm_head(verifier_norm(...))` of it (speculators/models/eagle3/core.py), with the draft model its
training command builds (`build_draft_model` from the `TrainConfig` our printed `speculators train` command
resolves to). So `--format specforge` must hold the post-norm final state and `--format safetensors` the
pre-norm one. The checkpoint is the embedded tiny DeepSeek-V3, whose norm weights are drawn from U(0.5, 1.5):
a state normalised twice is far from HF's logits there (with HF's initial norm weights of one it would not
be). The files' rows are HF float32's own (the server's are within 1e-6 of them, tests/e2e/test_exact_rows.py),
written in bf16; each teacher must match HF float32's logits within bf16 precision, row by row."""
import os
import sys

import pytest
import torch

from helpers import readers_path, specforge_losses, speculators_losses, trainer_env
from sglang_hs.tools import tiny_model
from sglang_hs.extract import output
from sglang_hs.extract.sinks import SafetensorsSink, SpecForgeSink

LAYERS = [2, 4, 5]
BF16_ROW_TOL = 0.02  # relative L2 per row of logits: bf16 states and weights (2^-8 each), a bf16 matmul


_readers_path = readers_path


def _readers():
    path = _readers_path()
    if not path:
        pytest.skip("requirements/readers.txt is not installed (run scripts/ensure_env.sh)")
    if path not in sys.path:
        sys.path.append(path)


def _record(r):
    """A reader's record of a server with --hs-last both; the sink picks the final state its trainer reads."""
    from types import SimpleNamespace

    return SimpleNamespace(last_hidden_state=r["post"], last_pre_norm=r["pre"])


def rel(got, ref):
    return (got.double() - ref.double()).norm(dim=-1) / ref.double().norm(dim=-1)


@pytest.fixture(scope="module")
def hf_rows():
    """HF float32 of the embedded checkpoint on a few sequences: the aux layers, the post-norm and pre-norm
    final states (the latter by a hook on model.model.norm's input) and the logits."""
    from transformers import AutoModelForCausalLM

    ckpt = tiny_model.ensure()
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(7)
    out = []
    for T in (9, 23, 40):
        ids = torch.randint(2, model.config.vocab_size, (T,), generator=g)
        taken = []
        h = model.model.norm.register_forward_hook(lambda mod, args, o: taken.append(args[0][0].detach()))
        with torch.no_grad():
            r = model(ids[None], output_hidden_states=True)
        h.remove()
        aux = torch.stack([r.hidden_states[i][0] for i in LAYERS], dim=1)
        out.append({"ids": ids, "mask": (torch.arange(T) >= T // 3).long(), "aux": aux,
                    "post": r.hidden_states[-1][0], "pre": taken[0], "logits": r.logits[0]})
    return ckpt, out


def test_the_post_norm_state_normalised_again_is_far_from_hf(hf_rows):
    """What the test below would catch: the final norm applied to the post-norm state (speculators on the
    files sglang-hs wrote before --hs-last pre-norm) gives other logits on this checkpoint."""
    ckpt, rows = hf_rows
    from safetensors import safe_open
    import json

    idx = json.load(open(os.path.join(ckpt, "model.safetensors.index.json")))["weight_map"]
    with safe_open(os.path.join(ckpt, idx["model.norm.weight"]), "pt") as f:
        w = f.get_tensor("model.norm.weight").float()
    with safe_open(os.path.join(ckpt, idx["lm_head.weight"]), "pt") as f:
        head = f.get_tensor("lm_head.weight").float()
    for r in rows:
        twice = torch.nn.functional.rms_norm(r["post"], w.shape, w, 1e-6) @ head.T
        err = rel(twice, r["logits"])
        print("double norm: logits off by", err.min().item(), "to", err.max().item())
        assert err.min() > 5 * BF16_ROW_TOL


def test_specforge_target_head_on_our_files_gives_hfs_logits(hf_rows, tmp_path):
    _readers()
    from specforge.data.preprocessing import build_offline_eagle3_dataset
    from specforge.modeling.target.target_head import TargetHead

    ckpt, rows = hf_rows
    sink = SpecForgeSink(str(tmp_path), "bf16")  # what the CLI writes for --format specforge
    for i, r in enumerate(rows):
        sink.write(i, r["ids"], r["mask"], r["aux"], sink.final_of(_record(r)))
    ds = build_offline_eagle3_dataset(str(tmp_path), max_len=4096)
    head = TargetHead.from_pretrained(ckpt)  # bf16, on the CPU here
    for j in range(len(ds)):
        i = int(os.path.basename(ds.datapaths[j])[len("data_"):-len(".ckpt")])
        item = ds[j]
        with torch.no_grad():
            logits = head(item["target"])[0]
        err = rel(logits, rows[i]["logits"])
        print(f"SpecForge sample {i}: logits off by at most {err.max().item():.4f}")
        assert logits.dtype == torch.bfloat16 and (err < BF16_ROW_TOL).all(), err
        assert (logits.float().argmax(-1) == rows[i]["logits"].argmax(-1)).float().mean() > 0.9


def test_speculators_teacher_on_our_files_gives_hfs_logits(hf_rows, tmp_path):
    _readers()
    try:
        from speculators.models.eagle3 import Eagle3DraftModel
        from speculators.train.cli import build_draft_model
        from speculators.train.config import TrainConfig
        from speculators.train.data import ArrowDataset
    except ImportError as e:
        pytest.skip(f"speculators' trainer does not import: {e}")
    import argparse

    ckpt, rows = hf_rows
    sink = SafetensorsSink(str(tmp_path), "bf16")  # --format safetensors of a bf16 server
    sink.layer_ids = LAYERS
    for i, r in enumerate(rows):
        sink.write(i, r["ids"], r["mask"], r["aux"], sink.final_of(_record(r)))
    assert sink.finalize() == {"rows": len(rows)}
    manifest = {"model_path": ckpt, "layer_ids": LAYERS, "num_hidden_layers": 8}
    argv = output.training_command(str(tmp_path), manifest, "safetensors", "bf16")[2:]
    cfg = TrainConfig.resolve(argv + ["--draft-attn-impl", "sdpa"])  # CPU: no flex attention
    args = argparse.Namespace(**cfg.flatten())
    model = build_draft_model(args, Eagle3DraftModel, None, None, tiny_model.config()["vocab_size"])
    model.load_verifier_weights()
    assert model.target_layer_ids == LAYERS
    ds = ArrowDataset(4096, str(tmp_path), on_missing="raise")
    for i, r in enumerate(rows):
        item = ds[i]
        with torch.no_grad():  # speculators/models/eagle3/core.py's targets
            logits = model.verifier_lm_head(model.verifier_norm(item["verifier_last_hidden_states"].float()))
        err = rel(logits, r["logits"])
        print(f"speculators sample {i}: logits off by at most {err.max().item():.4f}")
        assert (err < BF16_ROW_TOL).all(), err
        assert (logits.argmax(-1) == r["logits"].argmax(-1)).float().mean() > 0.9


def test_speculators_training_steps_on_our_files_lower_the_loss(hf_rows, tmp_path):
    """A few optimizer steps of speculators' own Eagle3 draft on our files, as its Trainer takes a step
    (CollateFn's batch, autocast to --hidden-states-dtype, model(**batch, **train_call_kwargs), backward,
    clip, AdamW), on the CPU: its eager loss, sdpa attention. The loss is finite and falls."""
    _readers()
    try:
        from speculators.models.eagle3 import Eagle3DraftModel
        from speculators.train.cli import build_draft_model
        from speculators.train.config import TrainConfig
        from speculators.train.data import ArrowDataset, CollateFn
    except ImportError as e:
        pytest.skip(f"speculators' trainer does not import: {e}")
    import argparse

    ckpt, rows = hf_rows
    sink = SafetensorsSink(str(tmp_path), "bf16")
    sink.layer_ids = LAYERS
    for i, r in enumerate(rows):
        sink.write(i, r["ids"], r["mask"], r["aux"], sink.final_of(_record(r)))
    sink.finalize()
    manifest = {"model_path": ckpt, "layer_ids": LAYERS, "num_hidden_layers": 8}
    argv = output.training_command(str(tmp_path), manifest, "safetensors", "bf16")[2:]
    cfg = TrainConfig.resolve(argv + ["--draft-attn-impl", "sdpa", "--loss-implementation", "eager"])
    args = argparse.Namespace(**cfg.flatten())
    model = build_draft_model(args, Eagle3DraftModel, None, None, tiny_model.config()["vocab_size"])
    model.load_verifier_weights()
    train_kwargs, _ = Eagle3DraftModel.get_trainer_kwargs(**vars(args))
    ds = ArrowDataset(4096, str(tmp_path), on_missing="raise")
    H = tiny_model.config()["hidden_size"]
    batch = CollateFn(sum(len(r["ids"]) for r in rows), H, len(LAYERS), dtype=torch.bfloat16)(
        [ds[i] for i in range(len(ds))])
    assert batch["error_records"] == 0
    losses = speculators_losses(model, batch, train_kwargs)
    print("speculators losses", losses)
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < 0.9 * losses[0], losses





def test_specforge_training_steps_on_our_files_lower_the_loss(hf_rows, tmp_path):
    """Three epochs of SpecForge 0.2.0's own offline EAGLE-3 step on our --format specforge files on the CPU: the
    run config the CLI writes (its load_config, with sdpa attention), its draft config resolved for it, its
    draft and training model (OnlineEagle3Model and the TargetHead, by the EAGLE-3 providers), its
    Eagle3TrainStrategy.forward_loss on the items its offline reader gives (one sample per batch), AdamW with
    its gradient clip. CPU by configuration only, in a process of its own since Triton reads it at import:
    TRITON_INTERPRET=1 (its Triton loss), TORCHDYNAMO_DISABLE=1, no FSDP wrap. The loss is finite and falls."""
    import json

    _readers()
    ckpt, rows = hf_rows
    out = tmp_path / "sf"
    sink = SpecForgeSink(str(out), "bf16")
    for i, r in enumerate(rows):
        sink.write(i, r["ids"], r["mask"], r["aux"], sink.final_of(_record(r)))
    manifest = {"model_path": ckpt, "layer_ids": LAYERS, "num_hidden_layers": 8, "context_len": 256}
    (tmp_path / "run.json").write_text(json.dumps(output.specforge_config(str(out), manifest)))
    losses = specforge_losses(tmp_path / "run.json")
    print("SpecForge losses per epoch", losses)
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0], losses


# SpecForge's own derivation of the EAGLE-3 draft config for the target (resolve_draft_config), written as a
# draft config file with the draft vocabulary set to the target's: SpecForge's default draft vocabulary
# (32000) exceeds the tiny model's (1024), which a real target's (DeepSeek-V3: 129280) does not.
SPECFORGE_DRAFT_CONFIG = """
import json, sys
from specforge.algorithms.eagle3 import providers
from specforge.config.schema import load_config
from specforge.training.model_loading import resolve_draft_config
cfg = load_config(sys.argv[1], [])
draft = resolve_draft_config(cfg, provider=providers.algorithm_providers().model.draft_config).to_dict()
draft["draft_vocab_size"] = draft["vocab_size"]
json.dump(draft, open(sys.argv[2], "w"))
"""


def test_the_printed_specforge_command_trains_on_the_cpu(hf_rows, tmp_path, capsys):
    """The command the extraction prints for --format specforge, run as printed (`specforge train --config
    RUN`, through `python -m specforge.cli`: the `specforge` script's shebang names the venv that installed
    it), for two optimizer steps on the CPU. Configuration only: SPECFORGE_DEVICE=cpu (gloo), TRITON_INTERPRET=1
    (its Triton loss), TORCHDYNAMO_DISABLE=1, and dotted overrides: sdpa attention, fsdp_sharding=NO_SHARD
    (SpecForge wraps the draft in DDP then; FSDP needs an accelerator), max_steps=2, and a draft config file
    with the tiny target's vocabulary. Both steps log a finite loss and the checkpoint of step 2 is saved
    where the run config says."""
    import json
    import re
    import shlex
    import subprocess

    _readers()
    if not os.path.isdir(os.path.join(_readers_path(), "accelerate")):
        pytest.skip("accelerate (SpecForge's CLI imports it) is not in the readers' folder: rerun "
                    "scripts/ensure_env.sh (requirements/readers.txt)")
    ckpt, rows = hf_rows
    out = tmp_path / "sf"
    sink = SpecForgeSink(str(out), "bf16")
    for i, r in enumerate(rows):
        sink.write(i, r["ids"], r["mask"], r["aux"], sink.final_of(_record(r)))
    manifest = {"model_path": ckpt, "layer_ids": LAYERS, "num_hidden_layers": 8, "context_len": 256, "last": [1],
                "vocab_size": tiny_model.config()["vocab_size"]}
    capsys.readouterr()
    output.print_training_command(str(out), manifest, "specforge", "bf16")
    printed = capsys.readouterr().err.splitlines()
    assert printed[0] == "[extract] train with SpecForge 0.2.0:", printed
    argv = shlex.split(printed[1])
    assert argv[:2] == ["specforge", "train"], argv
    env = trainer_env(SPECFORGE_DEVICE="cpu")
    run_config = argv[argv.index("--config") + 1]
    draft = tmp_path / "draft.json"
    proc = subprocess.run([sys.executable, "-c", SPECFORGE_DRAFT_CONFIG, run_config, str(draft)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = subprocess.run([sys.executable, "-m", "specforge.cli", *argv[1:], "training.attention_backend=sdpa",
                           "training.fsdp_sharding=NO_SHARD", "training.max_steps=2", "training.log_interval=1",
                           f"model.draft_model_config={draft}"], env=env, capture_output=True, text=True,
                          timeout=900, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"^step \d+: .*'loss': ([0-9.eE+-]+|nan|inf)", proc.stdout + proc.stderr,
                                           re.M)]
    print("specforge train on our files, loss per step:", losses)
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses))), losses  # one sample a step, shuffled:
    # the two are other samples' losses (the test above shows the loss falling over epochs of the same step)
    saved = json.load(open(run_config))["output_dir"]
    assert os.path.isdir(os.path.join(saved, "specforge-run-step2")), os.listdir(saved)
