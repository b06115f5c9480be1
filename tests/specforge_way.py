"""How SpecForge reads offline hidden-state files (specforge/runtime/data_plane/offline_reader.py and
specforge/algorithms/eagle3/data.py::normalize_offline_sample at sgl-project/SpecForge a6b6b02, read
for this test and restated here, not copied): walk the folder for *.ckpt / *.ckpt.gz, torch.load with
weights_only=False and mmap=True (torch's zip format), read exactly four keys, truncate to max_len,
zero the last position's loss mask, and build an all-ones attention mask."""
import os

import torch

KEYS = ("input_ids", "loss_mask", "hidden_state", "aux_hidden_state")


def find_files(root):
    out = []
    for d, _, names in os.walk(root):
        out += [os.path.join(d, n) for n in names if n.endswith((".ckpt", ".ckpt.gz"))]
    return sorted(out)


def load_sample(path, max_len=2048):
    raw = torch.load(path, weights_only=False, mmap=True)
    assert set(KEYS) <= set(raw), f"{path}: missing {set(KEYS) - set(raw)}"
    hidden_state = raw["aux_hidden_state"].squeeze(0)[:max_len].unsqueeze(0)
    target = raw["hidden_state"].squeeze(0)[:max_len].unsqueeze(0)
    input_ids = raw["input_ids"][:max_len].unsqueeze(0)
    loss_mask = raw["loss_mask"][:max_len].clone().unsqueeze(0)
    if loss_mask.numel() > 0:
        loss_mask[0, -1] = 0
    return {"input_ids": input_ids, "loss_mask": loss_mask, "hidden_state": hidden_state, "target": target,
            "attention_mask": torch.ones_like(loss_mask, dtype=torch.long)}
