"""--format safetensors: speculators 0.9.0's training layout. While the run goes: hs_{i}.safetensors per sample i
of --data, with hidden_states [T, K+1, H] (the K layers, then the final state BEFORE the final norm, which
speculators takes as the verifier's last hidden state and normalises itself: `verifier_lm_head(verifier_norm(
...))` in speculators/models/eagle3/core.py, as vLLM's extraction stores it), token_ids [T] int64 and loss_mask
[T] int64, and header metadata (final_state "pre-norm", num_aux_layers: the layer ids, layer_ids;
rows_per_layer where a layer id has more than one row: DeepSeek-V4's full hyper-connection streams, which
finalize refuses).

When the run completes, finalize() makes the folder what `speculators.train.data.ArrowDataset(max_len, DIR)`
reads: a `datasets` dataset saved with save_to_disk in DIR (columns input_ids, loss_mask, seq_len as
speculators' prepare_data writes them, types included, plus sample_index; torch format), one row per sample file in sample
order, and DIR/hidden_states/hs_{row}.safetensors (read by hs_connectors.FileTransfer) a hard link (a relative
symlink where the filesystem has no hard links) to that row's hs_{i}.safetensors. Sample files carry global
sample indices, so --shard outputs merge by copying their hs_*.safetensors into one folder and running
finalize there (`python -m sglang_hs.extract --finalize --output DIR`).

save_dtype "bf16" casts rows to bf16 (a float32 server's too); None (the CLI's default for this format) keeps
the dtype the server captured in. With "fp8" hidden_states is float8_e4m3fn with a float32
hidden_states_scales [T, 1, 1] beside it (speculators' FP8 scheme, sglang_hs/extract/fp8.py: train with
`--hidden-states-backend fp8`, whose FP8Transfer dequantizes; the plain file backend would hand the unscaled
values to training); "fp8-per-layer": scales [T, K+1, 1].

Speed (benchmarks/bench_host_path.py): when aux and last are the two views of one record's rows [T, K+1, H]
(as HiddenStateReader hands them out) and that storage holds nothing else, hidden_states is the rows tensor
itself, written as it lies without a copy.
"""
from __future__ import annotations

import glob
import os
import shutil
from typing import List, Optional, Tuple

from sglang_hs.extract.sinks.base import (Sink, SinkError, chunk_states, cut_short, in_order, link_sample_file,
                                          numbered_files, record_rows, write_at)


class SafetensorsSink(Sink):
    name, wants_last, final_state = "safetensors", True, "pre-norm"
    HS_DIR = "hidden_states"
    save_dtypes = (None, "bf16", "fp8", "fp8-per-layer")
    share_rows = True  # a record's rows are hidden_states as they lie (module docstring); False: torch.cat

    def path(self, index: int) -> str:
        return os.path.join(self.out_dir, f"hs_{index}.safetensors")

    def existing(self) -> int:
        return len(glob.glob(os.path.join(self.out_dir, "hs_*.safetensors")))

    def _save(self, tmp, input_ids, loss_mask, aux, last) -> None:
        import torch
        from safetensors.torch import save_file

        from sglang_hs.extract import fp8

        rows = record_rows(aux, last) if self.share_rows else None
        states = rows if rows is not None else aux if last is None else torch.cat([aux, last[:, None]], dim=1)
        meta = self._metadata(aux, last)
        tensors = {"token_ids": input_ids.contiguous(), "loss_mask": loss_mask.contiguous()}
        if self.save_dtype in ("fp8", "fp8-per-layer"):
            states, tensors[fp8.SCALES_KEY] = fp8.quantize(states, per_layer=self.save_dtype == "fp8-per-layer")
        tensors["hidden_states"] = states.contiguous()
        save_file(tensors, tmp, metadata=meta)

    def _metadata(self, aux, last) -> dict:
        meta = {"format": "sglang-hs", "final_state": self.final_state if last is not None else "false",
                "num_aux_layers": str(self.aux_layers(aux)), "fp8_scale": "none"}
        if self.rows_per_layer != 1:  # absent: one row per layer id (every file before hc streams)
            meta["rows_per_layer"] = str(self.rows_per_layer)
        if self.layer_ids is not None:
            meta["layer_ids"] = ",".join(str(i) for i in self.layer_ids)
        if self.save_dtype in ("fp8", "fp8-per-layer"):
            meta["fp8_scale"] = "per-layer" if self.save_dtype == "fp8-per-layer" else "per-token"
        return meta

    def writes_chunks(self, aux, last) -> bool:
        return True

    def _save_chunks(self, tmp, input_ids, loss_mask, aux, last, chunks) -> None:
        """_save's file a chunk of rows at a time: the header safetensors writes for these tensors first (its
        own header of a one-token sample, T put in: safetensors lays tensors out by dtype and name, and its
        offsets follow from the sizes), then each tensor's bytes at its offset, the rows as the chunks come
        (cast, or FP8-quantized: scales are per token, so per chunk)."""
        import torch
        from safetensors.torch import save

        from sglang_hs.extract import fp8

        T, H = aux.shape[0], aux.shape[2]
        R = aux.shape[1] + (last is not None)
        quant = self.save_dtype in ("fp8", "fp8-per-layer")
        per_layer = self.save_dtype == "fp8-per-layer"
        one = {"token_ids": input_ids[:1].contiguous(), "loss_mask": loss_mask[:1].contiguous(),
               "hidden_states": torch.zeros(1, R, H, dtype=fp8.FP8 if quant else self.out_dtype(aux.dtype))}
        if quant:
            one[fp8.SCALES_KEY] = torch.zeros(1, R if per_layer else 1, 1, dtype=torch.float32)
        header, at = _header_for(save(one, metadata=self._metadata(aux, last)), T)
        with open(tmp, "r+b") as f:
            f.write(header)
            write_at(f, at["token_ids"], input_ids)
            write_at(f, at["loss_mask"], loss_mask)
            states_at = at["hidden_states"]
            scales_at = at[fp8.SCALES_KEY] if quant else 0
            for c in in_order(chunks, T):
                states = chunk_states(c.aux, c.last)
                if quant:
                    states, scales = fp8.quantize(states, per_layer=per_layer)
                    write_at(f, scales_at + c.start * scales[0].numel() * 4, scales)
                else:
                    states = states.to(self.out_dtype(aux.dtype))
                write_at(f, states_at + c.start * states[0].numel() * states.element_size(), states)

    def remove_partial(self) -> int:
        n = super().remove_partial()
        for p in glob.glob(os.path.join(self.out_dir, ".hidden_states.*")) + glob.glob(
                os.path.join(self.out_dir, ".dataset.*")):
            shutil.rmtree(p, ignore_errors=True)  # a finalize that did not finish
        for p in glob.glob(os.path.join(self.out_dir, f".{TOKEN_FREQ}.*")):
            os.unlink(p)
        return n

    def samples(self) -> List[Tuple[int, str]]:
        """(sample index, path) of every complete sample file, in sample order."""
        return numbered_files(self.out_dir, "hs_", ".safetensors")

    def finalize(self) -> Optional[dict]:
        """Write speculators' dataset for the sample files in the folder (all of them: a resumed run's and
        copied-in shards' too) and rebuild hidden_states/ to match its rows. Returns {"rows": n}."""
        import datasets
        import torch
        from safetensors import safe_open

        self.remove_partial()
        files = self.samples()
        if not files:
            return {"rows": 0}
        ref, unreadable = None, []
        for index, p in files:  # every file must hold the same kind of rows, the final state last
            try:
                with safe_open(p, "pt") as f:
                    meta = f.metadata() or {}
                    hs = f.get_slice("hidden_states")
                    sig = (tuple(hs.get_shape()[1:]), hs.get_dtype(), meta.get("num_aux_layers"),
                           meta.get("layer_ids"), meta.get("fp8_scale", "none"), meta.get("rows_per_layer", "1"))
                    f.get_slice("token_ids"), f.get_slice("loss_mask")
            except Exception as e:  # noqa: BLE001 - SafetensorError (cut short, not safetensors), a tensor missing
                unreadable.append((p, f"{type(e).__name__}: {e}"))
                continue
            if meta.get("final_state") == "true":  # sglang-hs before --hs-last pre-norm: the post-norm state
                raise SinkError(f"{p} holds the final state after the final norm, which speculators normalises "
                                "again (it trains on the pre-norm state): extract it again from a server with "
                                "--hs-last pre-norm; no speculators dataset written")
            if meta.get("rows_per_layer", "1") != "1":
                raise SinkError(f"{p} holds {meta['rows_per_layer']} rows per layer id (DeepSeek-V4's hyper-connection "
                                "streams, --hs-hc-streams full); speculators' EAGLE-3 takes one row per layer id: "
                                "no speculators dataset written")
            if meta.get("final_state") != self.final_state:
                raise SinkError(f"{p} holds no final hidden state (its server ran without --hs-last), which "
                                "speculators trains on: no speculators dataset written")
            if ref is None:
                ref = (sig, p)
            elif sig != ref[0]:
                raise SinkError(f"{p} holds rows {sig} but {ref[1]} holds {ref[0]} (shape, dtype, aux layers, "
                                "layer ids, FP8 scale, rows per layer id): files of different captures cannot form one dataset")

        if unreadable:  # a copy cut short (a --shard output copied in): nothing is removed, the old dataset stays
            raise cut_short(unreadable, "speculators dataset")
        # the types prepare_data's dataset has: `datasets` stores a column named input_ids as int32 (its optimized
        # integer precision for tokenizer columns), the others as int64
        features = datasets.Features({"input_ids": datasets.Sequence(datasets.Value("int32")),
                                      "loss_mask": datasets.Sequence(datasets.Value("int64")),
                                      "seq_len": datasets.Value("int64"), "sample_index": datasets.Value("int64")})
        work = os.path.join(self.out_dir, f".dataset.{os.getpid()}")
        freq_tmp = os.path.join(self.out_dir, f".{TOKEN_FREQ}.{os.getpid()}")
        from sglang_hs.fsutil import make_private_dirs, set_private_mode, set_private_modes

        torch.save(token_frequencies(files), freq_tmp)  # speculators' draft vocabulary (--draft-vocab-size)
        set_private_mode(freq_tmp, self.share_gid)  # torch.save makes it 0644
        new_hs = os.path.join(self.out_dir, f".hidden_states.{os.getpid()}")

        make_private_dirs(new_hs, self.share_gid)
        bars = datasets.is_progress_bar_enabled()
        datasets.disable_progress_bars()
        try:
            ds = datasets.Dataset.from_generator(_speculators_rows, features=features, gen_kwargs={"files": files},
                                                 cache_dir=os.path.join(work, "cache"))
            ds.set_format(type="torch")  # speculators compares token_ids with input_ids as tensors
            ds.save_to_disk(os.path.join(work, "ds"))
            del ds
            set_private_modes(os.path.join(work, "ds"), self.share_gid)  # datasets writes 0644
            for row, (index, p) in enumerate(files):
                link_sample_file(p, os.path.join(new_hs, f"hs_{row}.safetensors"))
            # Swap in: the old dataset stops being one first (no state.json), so a crash midway leaves a
            # folder the trainer refuses, never rows paired with the wrong files; the next finalize fixes it.
            state = os.path.join(self.out_dir, "state.json")
            if os.path.exists(state):
                os.unlink(state)
            for p in glob.glob(os.path.join(self.out_dir, "data-*.arrow")):
                os.unlink(p)
            # speculators caches the vocabulary mapping it builds from token_freq.pt as d2t-N.npy / t2d-N.npy in
            # the data path and reads those first: stale ones of the files before would win over the new counts
            for p in glob.glob(os.path.join(self.out_dir, "d2t-*.npy")) + glob.glob(os.path.join(self.out_dir, "t2d-*.npy")):
                os.unlink(p)
            os.replace(freq_tmp, os.path.join(self.out_dir, TOKEN_FREQ))
            hs_dir = os.path.join(self.out_dir, self.HS_DIR)
            if os.path.exists(hs_dir):
                old = os.path.join(self.out_dir, f".hidden_states.old.{os.getpid()}")
                os.replace(hs_dir, old)
                shutil.rmtree(old)
            os.replace(new_hs, hs_dir)
            names = sorted(os.listdir(os.path.join(work, "ds")), key=lambda n: n == "state.json")
            for name in names:  # state.json last
                os.replace(os.path.join(work, "ds", name), os.path.join(self.out_dir, name))
        finally:
            if bars:
                datasets.enable_progress_bars()
            shutil.rmtree(work, ignore_errors=True)
            shutil.rmtree(new_hs, ignore_errors=True)
            if os.path.exists(freq_tmp):
                os.unlink(freq_tmp)
        return {"rows": len(files)}


def _header_for(one: bytes, T: int):
    """(the header bytes, {tensor name: where its bytes start in the file}) of a safetensors file whose tensors are
    those of `one` (a safetensors file of a one-token sample: every tensor [1, ...]) with T tokens each: the same
    JSON, shapes and offsets put in (the tensors in the same order, back to back), padded to 8 bytes with spaces as
    safetensors pads. SinkError if `one`'s header is not the JSON this writes (another safetensors layout)."""
    import json
    import struct

    n = struct.unpack("<Q", one[:8])[0]
    raw = one[8 : 8 + n]
    spec = json.loads(raw)
    if json.dumps(spec, separators=(",", ":"), ensure_ascii=False).encode() != raw.rstrip(b" "):
        raise SinkError("this safetensors version writes its header in another layout: no file written in chunks")
    at = 0
    for name in sorted((k for k in spec if k != "__metadata__"), key=lambda k: spec[k]["data_offsets"][0]):
        t = spec[name]
        begin, end = t["data_offsets"]
        if begin != at or t["shape"][0] != 1:
            raise SinkError(f"safetensors laid {name} out at {begin}, not {at}: no file written in chunks")
        size = (end - begin) * T
        t["shape"][0], t["data_offsets"] = T, [at * T, at * T + size]
        at += end - begin
    body = json.dumps(spec, separators=(",", ":"), ensure_ascii=False).encode()
    body += b" " * (-len(body) % 8)
    data_at = 8 + len(body)
    return struct.pack("<Q", len(body)) + body, {name: data_at + t["data_offsets"][0] for name, t in spec.items()
                                                 if name != "__metadata__"}


TOKEN_FREQ = "token_freq.pt"


def token_frequencies(files) -> dict:
    """{token id: count} over the loss-masked tokens (loss_mask 1) of the sample files, as speculators'
    save_token_frequency_distribution counts them (input_ids[loss_mask.bool()]) for token_freq.pt."""
    import collections

    from safetensors import safe_open

    counts: "collections.Counter[int]" = collections.Counter()
    for _, path in files:
        with safe_open(path, "pt") as f:
            ids, mask = f.get_tensor("token_ids"), f.get_tensor("loss_mask")
        tokens, n = ids[mask.bool()].unique(return_counts=True)
        counts.update(dict(zip(tokens.tolist(), n.tolist())))
    return dict(counts)


def _speculators_rows(files):
    """One dataset row per sample file (module level, imports inside: `datasets` hashes this function)."""
    from safetensors import safe_open

    for index, path in files:
        with safe_open(path, "pt") as f:
            ids, mask = f.get_tensor("token_ids"), f.get_tensor("loss_mask")
        yield {"input_ids": ids.tolist(), "loss_mask": mask.tolist(), "seq_len": len(ids), "sample_index": index}

