"""Training files, one per sample, written to a temporary name and renamed when complete (after an
fsync), so a crash never leaves a file that looks done and `--resume` can trust what exists.

  specforge     SpecForge's offline layout: rows_{k}-{k+2000}/data_{i}.ckpt, a torch.save dict
                (torch's zip format, loadable with mmap=True) with input_ids [T] int64, loss_mask [T]
                int64, hidden_state [1, T, H] (final post-norm state: SpecForge applies lm_head to it)
                and aux_hidden_state [1, T, K*H] (the K layers side by side), in the model's dtype.
  safetensors   speculators 0.9.0's training layout. While the run goes: hs_{i}.safetensors per sample i of
                --data, with hidden_states [T, K+1, H] (the K layers, then the final state BEFORE the final
                norm, which speculators takes as the verifier's last hidden state and normalises itself:
                `verifier_lm_head(verifier_norm(...))` in speculators/models/eagle3/core.py, as vLLM's
                extraction stores it), token_ids [T] int64 and loss_mask [T] int64, and header metadata
                (final_state "pre-norm", num_aux_layers: the layer ids, layer_ids; rows_per_layer where a
                layer id has more than one row: DeepSeek-V4's full hyper-connection streams, which finalize
                refuses). When the run
                completes, finalize() makes the folder what `speculators.train.data.ArrowDataset(max_len,
                DIR)` reads: a `datasets` dataset saved with save_to_disk in DIR (columns input_ids,
                loss_mask, seq_len as speculators' prepare_data writes them, plus sample_index; torch
                format), one row per sample file in sample order, and DIR/hidden_states/hs_{row}.safetensors
                (read by hs_connectors.FileTransfer) a hard link (a relative symlink where the filesystem
                has no hard links) to that row's hs_{i}.safetensors. Sample files carry global sample
                indices, so --shard outputs merge by copying their hs_*.safetensors into one folder and
                running finalize there (`python -m sglang_hs.extract --finalize --output DIR`).
                With save_dtype "fp8" hidden_states is float8_e4m3fn with a float32 hidden_states_scales
                [T, 1, 1] beside it (speculators' FP8 scheme, sglang_hs/extract/fp8.py: train with
                `--hidden-states-backend fp8`, whose FP8Transfer dequantizes; the plain file backend would
                hand the unscaled values to training); "fp8-per-layer": scales [T, K+1, 1].

save_dtype "bf16" casts rows to bf16 (a float32 server's too); None (the CLI's default) keeps the dtype the
server captured in. SpecForge 0.2.0 has no FP8 reader: its sink takes no FP8.

Speed (benchmarks/bench_host_path.py): when aux and last are the two views of one record's rows [T, K+1, H]
(as HiddenStateReader hands them out, copied or zero-copy) and that storage holds nothing else, both sinks
write those bytes as they lie, without copying them first: safetensors' hidden_states is the rows tensor
itself, and SpecForge's hidden_state and aux_hidden_state are saved as views sharing the one storage (torch
saves a shared storage once: the file is no bigger; torch.load gives them back as non-contiguous views,
which SpecForge's reader slices as it does any tensor). The SpecForge sink also skips torch.save's CRC-32
of every zip entry (torch.load does not need it; `unzip -t` then reports CRC errors): torch's flag is set
around the sink's own torch.save only (torch keeps it per thread: other threads' saves keep their CRC).
"""
from __future__ import annotations

import contextlib
import glob
import os
import re
import shutil
from typing import Callable, List, Optional, Tuple

import torch

from sglang_hs.extract import fp8

GROUP = 2000  # SpecForge's --file-group-size
TMP_SUFFIX = ".tmp"


def _commit(tmp: str, final: str) -> int:
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, final)
    return os.path.getsize(final)


class SinkError(RuntimeError):
    """A one-line error about the files in the output folder."""


class Sink:
    name = ""
    needs_last = False  # refuse a server without the final state
    wants_last = False  # start our own server with --hs-last
    final_state = "post-norm"  # which final state the trainer reads (--hs-last's value that captures it)

    save_dtypes: Tuple[Optional[str], ...] = (None, "bf16")

    def __init__(self, out_dir: str, save_dtype: Optional[str] = None) -> None:
        if save_dtype not in self.save_dtypes:
            raise SinkError(f"--format {self.name} cannot store --save-dtype {save_dtype}")
        self.out_dir = out_dir
        self.save_dtype = save_dtype
        self.share_gid: Optional[int] = None  # --output-group: files 0640 and folders 0750 of it (else 0600/0700)
        self.layer_ids: Optional[List[int]] = None  # recorded in the files where the format has room
        # aux rows per layer id: DeepSeek-V4 with --hs-hc-streams full captures hc_mult (the manifest's
        # rows_per_layer); aux [T, K * rows_per_layer, H] then holds stream s of the k-th id at row k*hc_mult+s
        self.rows_per_layer = 1

    def aux_layers(self, aux: torch.Tensor) -> int:
        """The layer ids `aux` [T, R, H] holds: R / rows_per_layer (SinkError when R does not fit this sink's
        layer ids and rows per layer)."""
        R, per = int(aux.shape[1]), int(self.rows_per_layer)
        K = R // per if per >= 1 and R % per == 0 else None
        if K is None or (self.layer_ids is not None and K != len(self.layer_ids)):
            want = f"{len(self.layer_ids)} layer ids x " if self.layer_ids is not None else "a multiple of "
            raise SinkError(f"aux holds {R} rows per token, expected {want}{per} rows per layer id")
        return K

    def finalize(self) -> Optional[dict]:
        """What a completed run adds beside the sample files; None when the format needs nothing."""
        return None

    def final_of(self, record):
        """The final state of a reader's record that this format stores (None if the server captured none)."""
        return record.last_hidden_state if self.final_state == "post-norm" else record.last_pre_norm

    def path(self, index: int) -> str:
        raise NotImplementedError

    def done(self, index: int) -> bool:
        return os.path.exists(self.path(index))

    def existing(self) -> int:
        raise NotImplementedError

    def remove_partial(self) -> int:
        """Delete the temporary files an interrupted run left; returns how many."""
        stale = glob.glob(os.path.join(self.out_dir, "**", f"*{TMP_SUFFIX}"), recursive=True)
        for p in stale:
            os.unlink(p)
        return len(stale)

    def write(self, index: int, input_ids: torch.Tensor, loss_mask: torch.Tensor, aux: torch.Tensor,
              last: Optional[torch.Tensor], before_commit: Optional[Callable[[], None]] = None) -> int:
        """Write one sample (aux [T, K * rows_per_layer, H], last [T, H]); returns the bytes written.
        `before_commit` is called once the bytes are in the temporary file, before it takes the sample's name:
        raising there leaves no file (the extraction CLI checks a zero-copy record's ring bytes were still its
        own)."""
        from sglang_hs.fsutil import create_private_file, make_private_dirs, set_private_mode

        self.aux_layers(aux)  # rows that do not fit the layer ids: refused before any file is made

        final = self.path(index)
        make_private_dirs(os.path.dirname(final), self.share_gid)
        tmp = final + f".{os.getpid()}{TMP_SUFFIX}"
        if self.save_dtype == "bf16":
            aux, last = aux.to(torch.bfloat16), None if last is None else last.to(torch.bfloat16)
        try:
            create_private_file(tmp, self.share_gid)  # its mode before any byte of it is written
            self._save(tmp, input_ids.long(), loss_mask.long(), aux, last)
            set_private_mode(tmp, self.share_gid)  # a writer that made a file of its own
            if before_commit is not None:
                before_commit()
            return _commit(tmp, final)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise

    def _save(self, tmp, input_ids, loss_mask, aux, last) -> None:
        raise NotImplementedError


def record_rows(aux: torch.Tensor, last: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The record's rows [T, K+1, H] when `aux` [T, K, H] and `last` [T, H] are its two views rows[:, :K] and
    rows[:, K] (what HiddenStateReader hands out) and their storage is exactly those rows; else None."""
    if last is None or aux.dim() != 3 or aux.dtype != last.dtype or aux.device != last.device:
        return None
    T, K, H = aux.shape
    storage = aux.untyped_storage()
    if T == 0 or last.untyped_storage().data_ptr() != storage.data_ptr() \
            or storage.nbytes() != T * (K + 1) * H * aux.element_size():
        return None
    if (aux.storage_offset(), aux.stride(), last.storage_offset(), last.stride(), last.shape) != \
            (0, ((K + 1) * H, H, 1), K * H, ((K + 1) * H, 1), (T, H)):
        return None
    return aux.as_strided((T, K + 1, H), ((K + 1) * H, H, 1), 0)


@contextlib.contextmanager
def _without_crc32():
    """torch.save in this thread skips the CRC-32 of its zip entries meanwhile (torch's config is per thread:
    a ContextVar since torch 2.x's config module)."""
    from torch.serialization import get_crc32_options, set_crc32_options

    before = get_crc32_options()
    set_crc32_options(False)
    try:
        yield
    finally:
        set_crc32_options(before)


def specforge_sample(input_ids: torch.Tensor, loss_mask: torch.Tensor, aux: torch.Tensor,
                     last: torch.Tensor, contiguous: bool = True, dtype: Optional[torch.dtype] = None) -> dict:
    """One sample in SpecForge's offline layout, as its data_{i}.ckpt holds it (input_ids [T] and
    loss_mask [T] int64, hidden_state [1, T, H], aux_hidden_state [1, T, K*H]); also what
    sglang_hs.live yields, so files and live samples cannot drift apart. contiguous=False: the states
    stay views of their rows where a view can hold them (the sink's shared rows). `dtype`: cast the states
    to it (None: as they come)."""
    T = input_ids.shape[0]
    hidden, aux = last.reshape(1, T, -1), aux.reshape(1, T, -1)
    if dtype is not None:
        hidden, aux = hidden.to(dtype), aux.to(dtype)
    if contiguous:
        hidden, aux = hidden.contiguous(), aux.contiguous()
    return {"input_ids": input_ids.long(), "loss_mask": loss_mask.long(), "hidden_state": hidden,
            "aux_hidden_state": aux}


class SpecForgeSink(Sink):
    name, needs_last, wants_last = "specforge", True, True
    crc32 = False  # torch.save's CRC-32 of every entry (True: as torch.save does by default)
    share_rows = True  # a record's rows saved as they lie (module docstring); False: contiguous copies

    def path(self, index: int) -> str:
        k = index // GROUP * GROUP
        return os.path.join(self.out_dir, f"rows_{k}-{k + GROUP}", f"data_{index}.ckpt")

    def existing(self) -> int:
        return len(glob.glob(os.path.join(self.out_dir, "rows_*", "data_*.ckpt")))

    def _save(self, tmp, input_ids, loss_mask, aux, last) -> None:
        shared = self.share_rows and record_rows(aux, last) is not None  # views of the one storage: saved once
        sample = specforge_sample(input_ids, loss_mask, aux, last, contiguous=not shared)
        with contextlib.nullcontext() if self.crc32 else _without_crc32():
            torch.save(sample, tmp)


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
        from safetensors.torch import save_file

        rows = record_rows(aux, last) if self.share_rows else None
        states = rows if rows is not None else aux if last is None else torch.cat([aux, last[:, None]], dim=1)
        meta = {"format": "sglang-hs", "final_state": self.final_state if last is not None else "false",
                "num_aux_layers": str(self.aux_layers(aux)), "fp8_scale": "none"}
        if self.rows_per_layer != 1:  # absent: one row per layer id (every file before hc streams)
            meta["rows_per_layer"] = str(self.rows_per_layer)
        if self.layer_ids is not None:
            meta["layer_ids"] = ",".join(str(i) for i in self.layer_ids)
        tensors = {"token_ids": input_ids.contiguous(), "loss_mask": loss_mask.contiguous()}
        if self.save_dtype in ("fp8", "fp8-per-layer"):
            per_layer = self.save_dtype == "fp8-per-layer"
            states, tensors[fp8.SCALES_KEY] = fp8.quantize(states, per_layer=per_layer)
            meta["fp8_scale"] = "per-layer" if per_layer else "per-token"
        tensors["hidden_states"] = states.contiguous()
        save_file(tensors, tmp, metadata=meta)

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
        out = []
        for p in glob.glob(os.path.join(self.out_dir, "hs_*.safetensors")):
            m = re.fullmatch(r"hs_(\d+)\.safetensors", os.path.basename(p))
            if m:
                out.append((int(m.group(1)), p))
        return sorted(out)

    def finalize(self) -> Optional[dict]:
        """Write speculators' dataset for the sample files in the folder (all of them: a resumed run's and
        copied-in shards' too) and rebuild hidden_states/ to match its rows. Returns {"rows": n}."""
        import datasets
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
            (p, why), others = unreadable[0], [os.path.basename(q) for q, _ in unreadable[1:]]
            nor = f", nor are {len(others)} more ({', '.join(others[:3])}{', ...' if len(others) > 3 else ''})"
            raise SinkError(f"{p} is not a whole sample file ({why})" + (nor if others else "")
                            + ": cut short (a copy that did not finish, a full disk?); copy it again, or delete it "
                            "and rerun the extraction with --resume to remake it; no speculators dataset written")
        features = datasets.Features({"input_ids": datasets.Sequence(datasets.Value("int64")),
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
                dst = os.path.join(new_hs, f"hs_{row}.safetensors")
                try:
                    os.link(p, dst)
                except OSError:  # no hard links here: a relative link survives moving the folder
                    os.symlink(os.path.join(os.pardir, os.path.basename(p)), dst)
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


SINKS = {s.name: s for s in (SpecForgeSink, SafetensorsSink)}
