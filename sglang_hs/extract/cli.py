"""python -m sglang_hs.extract --data FILE --output DIR [--server URL --hs-dump-dir DIR | <launcher flags>]
   python -m sglang_hs.extract --from-dump DIR --output DIR
   python -m sglang_hs.extract --finalize --format safetensors --output DIR

The command line in, the pipeline out: main() parses argv once into the typed configuration (config.py; the
flags and their --help are flags.py's), builds the stages from its pieces (the sink of --format, the dataset
source) and runs one of pipeline.py's runs, or finish.py's --finalize. A command line that cannot run is one
error line (exit 2) before anything is touched.
"""
from __future__ import annotations

import sys
from typing import List, Optional

from sglang_hs.extract.config import ExtractConfig, parse_args
from sglang_hs.extract.errors import PROG, ExtractError
from sglang_hs.extract.finish import finalize_only
from sglang_hs.extract.flags import build_parser  # noqa: F401 (the parser, importable here as before)
from sglang_hs.extract.pipeline import run_data, run_harvest
from sglang_hs.extract.sinks import SINKS
from sglang_hs.extract.sources.dataset_file import DatasetSource, model_side
from sglang_hs.extract.sources.launch import last_state_for
from sglang_hs.extract.sources.server import Extraction  # noqa: F401 (the --data run's engine, as before)

# The sample preparer and --verify's lm_head for the server's model: the one stage main() hands down as a
# function, looked up here when main() runs (a test stands in its own preparer by setting this name).
_model_side = model_side


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        config, _ = parse_args(argv)
    except ExtractError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    out = config.output
    sink = SINKS[out.format](out.dir, out.save_dtype, share_gid=out.gid)
    if config.mode == "finalize":
        return finalize_only(out, sink)
    if config.mode == "harvest":
        return run_harvest(out, sink, config.harvest, config.facts, config.torch_threads)
    source = DatasetSource(config.data, config.selection, config.max_samples)
    return run_data(out, sink, source, config.server, config.requests, config.facts, config.torch_threads,
                    config.progress, model_side=_model_side)


# -- a parsed command line's sample selection and server, by the names they had here ------------------------

def node_route(config: ExtractConfig, reader) -> None:
    """The node split of the dump `reader` reads (selection.py)."""
    config.selection.split_by_node(reader.manifest)


def selected(config: ExtractConfig, index: int) -> bool:
    return config.selection.takes(index)


def routed_dp_rank(config: ExtractConfig, index: int) -> Optional[int]:
    return config.selection.routed_rank(index)


def server_last(config: ExtractConfig) -> str:
    """The --hs-last of a server this command starts (sources/launch.py)."""
    return last_state_for(config.output.format, config.requests.verify)
