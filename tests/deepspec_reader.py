"""A reader of DeepSpec's target cache v2 written from the format's published layout (not from
sglang_hs/extract/sinks/deepspec.py), for the tests: manifest.json, samples.idx of little-endian 56-byte records
(sample_id u64, shard_id u32, seq_len u32, then five u64 byte offsets into that shard: input_ids, attention_mask,
loss_mask, target_hidden_states, target_last_hidden_states) and the shards' raw bytes (input_ids int32, masks
uint8, the states [T, K*H] and [T, H] in the manifest's hidden_dtype). DeepSpec is on no package registry, so its
own CacheDataset is not loaded by the tests (docs/extract.md says how its code was compared)."""
import json
import os
import struct

import numpy as np
import torch

RECORD = "<QIIQQQQQ"


def read_cache(cache_dir):
    """Every sample of a DeepSpec target cache as DeepSpec hands it to training, with its record and the
    states' raw dtype: [(record, {input_ids, attention_mask, loss_mask, target_hidden_states,
    target_last_hidden_states})], and the manifest."""
    with open(os.path.join(cache_dir, "manifest.json")) as f:
        m = json.load(f)
    assert m["version"] == 2 and m["token_dtype"] == "int32" and m["mask_dtype"] == "uint8"
    assert m["index_record_size"] == struct.calcsize(RECORD) == 56
    assert m["num_shards"] == len(m["shards"]) and [s["shard_id"] for s in m["shards"]] == list(range(m["num_shards"]))
    assert m["target_layer_ids"] == sorted(m["target_layer_ids"])
    dtype = {"bfloat16": torch.bfloat16, "float8_e4m3fn": torch.float8_e4m3fn,
             "float8_e5m2": torch.float8_e5m2}[m["hidden_dtype"]]
    H, K = m["hidden_size"], len(m["target_layer_ids"])
    idx = open(os.path.join(cache_dir, "samples.idx"), "rb").read()
    assert len(idx) == 56 * m["num_samples"]
    out = []
    for n in range(m["num_samples"]):
        rec = struct.unpack_from(RECORD, idx, 56 * n)
        sample_id, shard_id, T, o_ids, o_att, o_mask, o_hid, o_last = rec
        assert sample_id == n
        data = open(os.path.join(cache_dir, m["shards"][shard_id]["file_name"]), "rb").read()

        def take(offset, count, np_dtype):
            nbytes = count * np.dtype(np_dtype).itemsize
            assert offset + nbytes <= len(data), (n, offset, nbytes, len(data))
            return torch.from_numpy(np.frombuffer(data, np_dtype, count, offset).copy())

        e = dtype.itemsize
        hid = take(o_hid, T * K * H * e, np.uint8).view(dtype).view(T, K * H)
        last = take(o_last, T * H * e, np.uint8).view(dtype).view(T, H)
        out.append((rec, {"input_ids": take(o_ids, T, np.int32), "attention_mask": take(o_att, T, np.uint8),
                          "loss_mask": take(o_mask, T, np.uint8), "target_hidden_states": hid,
                          "target_last_hidden_states": last}))
    return out, m
