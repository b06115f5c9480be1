"""DeepSeek-V4 `--hs-hc-streams full`: SGLang's DSpark capture keeps every hyper-connection stream.

See the ledger in sglang_hs/server/patches/__init__.py. SGLang 0.5.23's DeepseekV4Model captures a dspark layer
as `mhc_stream_mean(x, out=packer.slot(x[:, 0]))` on every path (x: [T, hc_mult, H]; the packer an
`AuxHiddenStatePacker` made in the forward, one H-wide slot per capture). Two pieces, applied once the V4
overlay is built with full streams:

- `deepseek_v4.AuxHiddenStatePacker` (the name the forward looks up) becomes `StreamsPacker`: each slot is
  hc_mult x H wide, so the packed aux is [T, K * hc_mult * H] (stream s of capture k at columns
  (k*hc_mult + s)*H), the rows the store takes as hc_mult rows per layer id.
- `mhc.mhc_stream_mean` (imported by the forward at call time) writes the streams, `x.flatten(1)`, into an
  `out` that is hc_mult x H wide; any other call runs the original. The originals stay in `ORIGINALS`.

Both are shape logic and one copy, as upstream's: safe inside a captured CUDA graph.
"""
from __future__ import annotations

from sglang_hs.version import SGLANG_VERSION

ORIGINALS = {}
_hc_mult = None


def streams_or_mean(x, out=None):
    """`mhc_stream_mean`, except into an hc_mult x H wide `out`: the streams themselves, flattened."""
    m, hc, h = x.shape
    if out is not None and out.shape[-1] == hc * h:
        return out.copy_(x.reshape(m, hc * h))
    return ORIGINALS["mhc_stream_mean"](x, out=out)


def make_streams_packer(base, hc_mult: int):
    class StreamsPacker(base):
        """The aux packer with hc_mult x H wide slots, one per captured layer (upstream's `slot` with the
        width multiplied; `append` of an H-wide state into one fails loudly on the copy's shape)."""

        def slot(self, like):
            width = int(like.shape[-1]) * hc_mult
            if self._feature_size is None:
                self._feature_size = width
                shape = (*like.shape[:-1], width * self._num_captures)
                if self._buffer is None:
                    self._buffer = like.new_empty(shape)
                elif self._buffer.shape != shape or self._buffer.dtype != like.dtype:
                    raise ValueError(f"aux hidden output buffer is {tuple(self._buffer.shape)} {self._buffer.dtype}, "
                                     f"full-stream captures need {shape} {like.dtype}")
            elif width != self._feature_size:
                raise ValueError(f"sglang-hs: a {width}-wide stream capture after {self._feature_size}-wide ones")
            start = self._idx * self._feature_size
            self._idx += 1
            return self._buffer[..., start:start + self._feature_size]

    return StreamsPacker


def apply(hc_mult: int) -> str:
    global _hc_mult
    if _hc_mult is not None:
        if _hc_mult != hc_mult:
            raise RuntimeError(f"sglang-hs: hc_full_streams applied for hc_mult {_hc_mult}, asked for {hc_mult}")
        return "already applied"
    from sglang.kernels.ops.layernorm import mhc
    from sglang.srt.models import deepseek_v4

    ORIGINALS["mhc_stream_mean"] = mhc.mhc_stream_mean
    ORIGINALS["AuxHiddenStatePacker"] = deepseek_v4.AuxHiddenStatePacker
    mhc.mhc_stream_mean = streams_or_mean
    deepseek_v4.AuxHiddenStatePacker = make_streams_packer(ORIGINALS["AuxHiddenStatePacker"], hc_mult)
    _hc_mult = hc_mult
    return f"hc_full_streams(sglang {SGLANG_VERSION}, hc_mult {hc_mult})"


def restore() -> None:
    """Put the originals back (tests)."""
    global _hc_mult
    if _hc_mult is None:
        return
    from sglang.kernels.ops.layernorm import mhc
    from sglang.srt.models import deepseek_v4

    mhc.mhc_stream_mean = ORIGINALS["mhc_stream_mean"]
    deepseek_v4.AuxHiddenStatePacker = ORIGINALS["AuxHiddenStatePacker"]
    _hc_mult = None
