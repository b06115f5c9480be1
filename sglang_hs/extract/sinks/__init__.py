"""Where training samples go: one sink per --format, behind sinks/base.py's interface (write(sample),
finalize(), resume_state()). Files are written to a temporary name and renamed when complete (after an fsync),
so a crash never leaves a file that looks done and `--resume` can trust what exists.

  specforge     SpecForge's offline layout (sinks/specforge.py)
  safetensors   speculators' layout: hs_{i}.safetensors per sample, and the Arrow dataset over them when the
                run completes (sinks/speculators.py)
  deepspec      DeepSpec's target cache v2: sample_{i}.bin per sample, and target_cache/ (manifest.json,
                samples.idx, shard-*.bin) over them when the run completes (sinks/deepspec.py)

A new format is a file here with a Sink subclass, and its line in SINKS (the --format choices, in this order).
"""
from sglang_hs.extract.sinks.base import (TMP_SUFFIX, ResumeState, Sink, SinkError,  # noqa: F401 (the interface)
                                          TrainingSample, record_rows)
from sglang_hs.extract.sinks.specforge import GROUP, SpecForgeSink, specforge_sample  # noqa: F401
from sglang_hs.extract.sinks.speculators import SafetensorsSink, TOKEN_FREQ, token_frequencies  # noqa: F401
from sglang_hs.extract.sinks.deepspec import DeepSpecSink, deepspec_sample  # noqa: F401

SINKS = {s.name: s for s in (
    SpecForgeSink,
    SafetensorsSink,
    DeepSpecSink,
)}
