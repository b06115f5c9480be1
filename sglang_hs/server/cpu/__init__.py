"""CPU-engine support, used only in CPU mode (no CUDA device, or --device cpu)."""
import os


def stubs_dir() -> str:
    """The folder the launcher puts first on PYTHONPATH so `import sgl_kernel` and `import flashinfer` find
    the stand-ins (stubs/sgl_kernel, stubs/flashinfer)."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "stubs")
