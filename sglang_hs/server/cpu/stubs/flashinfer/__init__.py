"""Import stand-in that leaves FlashInfer out of SGLang's CPU engine (on PYTHONPATH in CPU mode only).

SGLang's own CPU install (`python/pyproject_cpu.toml`) has no flashinfer, and its CPU engine never calls it: the
sites it reaches ask `is_flashinfer_available()` (which needs CUDA) or import it under `try: ... except
ImportError`; the unguarded ones are on CUDA-only paths. PyPI's sglang installs flashinfer-python all the same, and
every SGLang process imports it (and cutlass through it) at start from `quantization/fp4_utils.py`'s guarded
import, a few CPU-seconds per process on the 2-core test machine (benchmarks/bench_cpu_imports.py), a hundred-odd
processes a suite. The launcher puts this folder's parent first on PYTHONPATH in CPU mode only, so `import
flashinfer` lands here and fails the way it does on SGLang's CPU install: a ModuleNotFoundError, which those
guards expect.
"""

raise ModuleNotFoundError(
    "flashinfer is left out of SGLang's CPU engine by sglang-hs (sglang_hs/server/cpu/stubs/flashinfer); "
    "a GPU server imports the real one",
    name="flashinfer",
)
