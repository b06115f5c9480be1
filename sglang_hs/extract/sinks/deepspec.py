"""--format deepspec: DeepSpec's "target cache" (version 2), what its DSpark / EAGLE-3 trainers read through
`deepspec.data.target_cache_dataset.CacheDataset(DIR/target_cache)`.

The cache, as DeepSpec's dataset code reads it (deepseek-ai/DeepSpec, deepspec/data/target_cache_dataset.py):

  manifest.json   version 2, num_samples, num_shards, target_layer_ids (sorted), hidden_dtype, token_dtype
                  "int32", mask_dtype "uint8", index_record_size 56, hidden_size, shards [{shard_id, file_name}]
                  (ids 0.. in order), target_model_name_or_path (its trainer checks it against its config)
  samples.idx     one record per sample, sample_id dense from 0 in file order, little-endian "<QIIQQQQQ"
                  (56 bytes): sample_id u64, shard_id u32, seq_len u32, then the u64 byte offsets in that shard
                  of input_ids, attention_mask, loss_mask, target_hidden_states, target_last_hidden_states
  shard files     raw bytes at those offsets: input_ids int32 [T], attention_mask uint8 [T] (all 1), loss_mask
                  uint8 [T], target_hidden_states [T, K*H] (the K layers side by side), target_last_hidden_states
                  [T, H] (the final state AFTER the final norm: DeepSpec takes AutoModel's last_hidden_state)

Layer ids: DeepSpec's id j is the output of decoder layer j (0-based; a forward hook on layers[j]), -1 the
embeddings, i.e. HF output_hidden_states[j + 1]; ours (the manifest's `convention`) is the residual stream
ENTERING layer i, HF output_hidden_states[i]. So DeepSpec's id is ours minus one (our 0, the embeddings, is its
-1); the manifest records both and the conventions. DeepSpec's id n-1 (the last layer's output, before the final
norm) is our id n on DeepSeek-V4 (the streams leaving the last layer, hc_head's input: server/layer_source.py) and
no layer id of ours on the other models (there it is --hs-last pre-norm).

hidden_dtype: "bfloat16" (the default, and the only one DeepSpec's released reader takes), or the FP8 dtypes of
DeepSpec's FP8 cache proposal (deepseek-ai/DeepSpec#26, #27, not merged): "float8_e4m3fn" (--save-dtype fp8) or
"float8_e5m2" (--save-dtype fp8-e5m2), one byte per element, a plain cast with no scale; the reader casts back to
bf16. A cast has no scale to fit large values: a sample with a value beyond the dtype's largest finite one
(448 for e4m3fn, which torch would saturate silently; 57344 for e5m2) is refused, not stored clipped.

While the run goes, one file per sample i, sample_{i}.bin: a header (magic, then JSON: what the sample holds,
the layer ids, the model; padded to 64 bytes) followed by the sample's bytes exactly as DeepSpec's writer lays
one sample out in a shard (the five tensors back to back, in the order above). finalize() makes DIR/target_cache:
row r (the r-th sample file in sample order) is shard r, `shard-{r:05d}.bin`, a hard link to its sample file
(a relative symlink where there are no hard links: no extra disk), samples.idx pointing past each header, and
manifest.json (also `sglang_hs`: our layer ids, both conventions, each row's sample index). The folder's own
manifest.json stays the extraction's. --shard outputs merge by copying their sample_*.bin into one folder and
running `python -m sglang_hs.extract --finalize --format deepspec --output DIR` there.
"""
from __future__ import annotations

import glob
import json
import os
import shutil
import struct
from typing import TYPE_CHECKING, List, Optional, Tuple

from sglang_hs.extract.sinks.base import Sink, SinkError, cut_short, in_order, link_sample_file, numbered_files, write_at

if TYPE_CHECKING:
    import torch

CACHE_DIR = "target_cache"
VERSION = 2
INDEX_RECORD = struct.Struct("<QIIQQQQQ")  # DeepSpec's INDEX_RECORD_STRUCT: 56 bytes
MAGIC = b"SGLHSDS1"
HEADER_ALIGN = 64
# --save-dtype -> DeepSpec's hidden_dtype (and the torch dtype of its bytes)
HIDDEN_DTYPES = {"bf16": "bfloat16", "fp8": "float8_e4m3fn", "fp8-e5m2": "float8_e5m2"}
LAYER_CONVENTION = {
    "sglang_hs": "layer id i = the residual stream entering decoder layer i = HF output_hidden_states[i]",
    "deepspec": "target layer id j = the output of decoder layer j (0-based) = HF output_hidden_states[j + 1]; "
                "-1 = the embeddings (HF output_hidden_states[0])",
    "translation": "deepspec target_layer_ids = sglang_hs layer_ids - 1",
}


def deepspec_layer_ids(layer_ids) -> List[int]:
    """DeepSpec's target_layer_ids of our layer ids (module docstring)."""
    return [int(i) - 1 for i in layer_ids]


def hidden_dtype(name: str) -> "torch.dtype":
    import torch

    return getattr(torch, name)


def fit_hidden(x: "torch.Tensor", dtype: "torch.dtype") -> "torch.Tensor":
    """x cast to `dtype`; for FP8, NonFiniteRows / FP8OutOfRange (one line) when x holds a value the cast cannot
    store."""
    import torch

    from sglang_hs.extract.fp8 import FP8OutOfRange, NonFiniteRows

    if dtype.itemsize != 1:
        return x.to(dtype)
    amax = float(x.float().abs().max()) if x.numel() else 0.0
    if amax != amax or amax == float("inf"):
        raise NonFiniteRows("hidden states hold inf or NaN: no FP8 cast stores them")
    top = torch.finfo(dtype).max
    if amax > top:
        raise FP8OutOfRange(f"its hidden states reach {amax:g}, beyond {str(dtype)[6:]}'s largest finite value {top:g} "
                         "(DeepSpec's FP8 cache is a plain cast, no scale): use --save-dtype fp8-e5m2 or bf16")
    return x.to(dtype)


def deepspec_sample(input_ids: "torch.Tensor", loss_mask: "torch.Tensor", aux: "torch.Tensor", last: "torch.Tensor",
                    dtype: Optional["torch.dtype"] = None) -> dict:
    """One sample as DeepSpec's CacheDataset hands it to training: input_ids int32 [T], loss_mask uint8 [T],
    target_hidden_states [T, K*H] and target_last_hidden_states [T, H] (post-norm). `dtype`: the cache's
    hidden dtype (None: as they come); an FP8 dtype gives what DeepSpec's FP8 reader returns, the cast read back
    as bf16. Also what sglang_hs.live yields with layout="deepspec", so files and live rows cannot drift apart."""
    import torch

    T = input_ids.shape[0]
    hidden, final = aux.reshape(T, -1), last.reshape(T, -1)
    if dtype is not None:
        hidden, final = fit_hidden(hidden, dtype), fit_hidden(final, dtype)
        if dtype.itemsize == 1:
            hidden, final = hidden.to(torch.bfloat16), final.to(torch.bfloat16)
    return {"input_ids": input_ids.to(torch.int32), "loss_mask": loss_mask.to(torch.uint8),
            "target_hidden_states": hidden.contiguous(), "target_last_hidden_states": final.contiguous()}


def _raw(x: "torch.Tensor") -> bytes:
    import torch

    x = x.contiguous()
    return x.view(torch.uint8).numpy().tobytes() if x.dtype.is_floating_point else x.numpy().tobytes()


def read_header(path: str) -> Tuple[dict, int]:
    """(the header's JSON, the offset of the sample's bytes) of a sample file; ValueError if it has none."""
    with open(path, "rb") as f:
        head = f.read(len(MAGIC) + 4)
        if len(head) < len(MAGIC) + 4 or head[:len(MAGIC)] != MAGIC:
            raise ValueError("no sglang-hs DeepSpec sample header")
        (n,) = struct.unpack("<I", head[len(MAGIC):])
        meta = json.loads(f.read(n))
    start = len(MAGIC) + 4 + n
    return meta, -(-start // HEADER_ALIGN) * HEADER_ALIGN


def sample_nbytes(meta: dict) -> List[int]:
    """The byte sizes of input_ids, attention_mask, loss_mask, target_hidden_states, target_last_hidden_states."""
    T, H, K = int(meta["seq_len"]), int(meta["hidden_size"]), int(meta["num_target_layers"])
    e = hidden_dtype(meta["hidden_dtype"]).itemsize
    return [4 * T, T, T, T * K * H * e, T * H * e]


class DeepSpecSink(Sink):
    name, needs_last, wants_last = "deepspec", True, True
    save_dtypes = (None, "bf16", "fp8", "fp8-e5m2")

    def __init__(self, out_dir: str, save_dtype: Optional[str] = None, share_gid: Optional[int] = None) -> None:
        super().__init__(out_dir, save_dtype, share_gid)
        self.model_path: Optional[str] = None

    def describe_capture(self, manifest: dict) -> None:
        super().describe_capture(manifest)
        self.model_path = manifest.get("model_path")

    @property
    def hidden_dtype(self) -> str:
        return HIDDEN_DTYPES[self.save_dtype or "bf16"]

    def path(self, index: int) -> str:
        return os.path.join(self.out_dir, f"sample_{index}.bin")

    def existing(self) -> int:
        return len(self.samples())

    def samples(self) -> List[Tuple[int, str]]:
        """(sample index, path) of every complete sample file, in sample order."""
        return numbered_files(self.out_dir, "sample_", ".bin")

    def _header(self, aux, last) -> bytes:
        """The sample file's header (magic, JSON, padded to 64 bytes)."""
        if last is None:
            raise SinkError("--format deepspec needs the final post-norm state (target_last_hidden_states): the "
                            "server runs without --hs-last")
        K = self.aux_layers(aux)
        T, H = int(aux.shape[0]), int(aux.shape[-1])
        ids = self.layer_ids  # None: no capture described (finalize refuses such files)
        meta = {"format": "sglang-hs deepspec target cache sample", "seq_len": T, "hidden_size": H,
                "num_target_layers": K, "hidden_dtype": self.hidden_dtype, "layer_ids": ids,
                "target_layer_ids": None if ids is None else deepspec_layer_ids(ids),
                "target_model_name_or_path": self.model_path, "final_state": self.final_state}
        body = json.dumps(meta).encode()
        header = MAGIC + struct.pack("<I", len(body)) + body
        return header + b"\0" * (-len(header) % HEADER_ALIGN)

    def _save(self, tmp, input_ids, loss_mask, aux, last) -> None:
        import torch

        header = self._header(aux, last)
        T, H = int(aux.shape[0]), int(aux.shape[-1])
        dtype = hidden_dtype(self.hidden_dtype)
        hidden, final = fit_hidden(aux.reshape(T, self.aux_layers(aux) * H), dtype), fit_hidden(last, dtype)
        with open(tmp, "wb") as f:  # the order and bytes of DeepSpec's write_sample_bytes
            for part in (header, _raw(input_ids.to(torch.int32)), b"\1" * T, _raw(loss_mask.to(torch.uint8)),
                         _raw(hidden), _raw(final)):
                f.write(part)

    def writes_chunks(self, aux, last) -> bool:
        return last is not None

    def _save_chunks(self, tmp, input_ids, loss_mask, aux, last, chunks) -> None:
        """_save's file a chunk of rows at a time: header, token ids and masks, then each chunk's aux rows and final
        states at their offsets in the two row blocks (an FP8 cast is checked per chunk: a value it cannot store
        refuses the sample as before, the message naming the chunk's largest value)."""
        import torch

        header = self._header(aux, last)
        T, H = int(aux.shape[0]), int(aux.shape[-1])
        dtype = hidden_dtype(self.hidden_dtype)
        e = dtype.itemsize
        R = self.aux_layers(aux)  # aux [T, R, H] is written as [T, R * H], as _save's reshape
        hidden_at = len(header) + 6 * T
        final_at = hidden_at + T * R * H * e
        with open(tmp, "r+b") as f:
            for part in (header, _raw(input_ids.to(torch.int32)), b"\1" * T, _raw(loss_mask.to(torch.uint8))):
                f.write(part)
            for c in in_order(chunks, T):
                write_at(f, hidden_at + c.start * R * H * e, fit_hidden(c.aux.reshape(c.stop - c.start, R * H), dtype))
                write_at(f, final_at + c.start * H * e, fit_hidden(c.last, dtype))

    def remove_partial(self) -> int:
        n = super().remove_partial()
        for p in glob.glob(os.path.join(self.out_dir, f".{CACHE_DIR}.*")):
            shutil.rmtree(p, ignore_errors=True)  # a finalize that did not finish
        return n

    def finalize(self) -> Optional[dict]:
        """Write DIR/target_cache over every sample file in the folder (a resumed run's and copied-in shards'
        too). Returns {"rows": n}."""
        from sglang_hs.fsutil import make_private_dirs, write_private_file

        self.remove_partial()
        files = self.samples()
        if not files:
            return {"rows": 0}
        ref, unreadable, rows = None, [], []
        for index, p in files:
            try:
                meta, start = read_header(p)
                size = sum(sample_nbytes(meta))
                if os.path.getsize(p) != start + size:
                    raise ValueError(f"{os.path.getsize(p)} bytes, its header says {start + size}")
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
                unreadable.append((p, f"{type(e).__name__}: {e}"))
                continue
            sig = {k: meta[k] for k in ("hidden_size", "num_target_layers", "hidden_dtype", "layer_ids",
                                        "target_model_name_or_path", "final_state")}
            if ref is None:
                ref = (sig, p)
            elif sig != ref[0]:
                raise SinkError(f"{p} holds {sig} but {ref[1]} holds {ref[0]}: files of different captures cannot "
                                "form one DeepSpec target cache")
            rows.append((index, p, meta, start))
        if unreadable:  # nothing is removed, the cache already there stays
            raise cut_short(unreadable, "DeepSpec target cache")
        sig = ref[0]
        if sig["layer_ids"] is None:
            raise SinkError(f"{ref[1]} records no layer ids (written without the server's manifest), which DeepSpec's "
                            "target_layer_ids must say: no DeepSpec target cache written")
        work = os.path.join(self.out_dir, f".{CACHE_DIR}.{os.getpid()}")
        make_private_dirs(work, self.share_gid)
        try:
            index, shards = bytearray(), []
            for row, (sample, p, meta, start) in enumerate(rows):
                name = f"shard-{row:05d}.bin"
                link_sample_file(p, os.path.join(work, name))
                offsets, at = [], start
                for n in sample_nbytes(meta):
                    offsets.append(at)
                    at += n
                index += INDEX_RECORD.pack(row, row, int(meta["seq_len"]), *offsets)
                shards.append({"shard_id": row, "file_name": name})
            write_private_file(work, "samples.idx", bytes(index), self.share_gid)
            manifest = {
                "version": VERSION, "num_samples": len(rows), "num_shards": len(shards),
                "target_layer_ids": deepspec_layer_ids(sig["layer_ids"]),
                "hidden_dtype": sig["hidden_dtype"], "token_dtype": "int32", "mask_dtype": "uint8",
                "index_record_size": INDEX_RECORD.size, "hidden_size": sig["hidden_size"], "shards": shards,
                "target_model_name_or_path": sig["target_model_name_or_path"],
                "sglang_hs": {"layer_ids": sig["layer_ids"], "layer_id_convention": LAYER_CONVENTION,
                              "target_last_hidden_states": "the final state after the final norm (HF "
                                                           "output_hidden_states[num_hidden_layers])",
                              "sample_indices": [r[0] for r in rows]},
            }
            write_private_file(work, "manifest.json", json.dumps(manifest, indent=1, sort_keys=True).encode(),
                               self.share_gid)
            cache = os.path.join(self.out_dir, CACHE_DIR)
            if os.path.exists(cache):  # the old cache goes first: a crash midway leaves none, never a stale one
                old = os.path.join(self.out_dir, f".{CACHE_DIR}.old.{os.getpid()}")
                os.replace(cache, old)
                shutil.rmtree(old)
            os.replace(work, cache)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        return {"rows": len(rows)}
