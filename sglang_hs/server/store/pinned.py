"""Page-lock a host mapping for the GPU and get the address the GPU writes it through.

Uses the extension's `host_register` (csrc/cuda_host.cpp) when it was built with CUDA; otherwise
torch's own binding of cudaHostRegister, with the host address as the device address (valid under
unified addressing on devices that can use host pointers for registered memory: every Linux x86-64
system with a Pascal or newer GPU).
"""
from __future__ import annotations

import torch

from sglang_hs._ext import ExtensionNotBuilt, ext

_PORTABLE, _MAPPED = 1, 2


def _cuda_ext():
    try:
        C = ext()
    except ExtensionNotBuilt:
        return None
    return C if C.with_cuda else None


def register(buf: torch.Tensor) -> int:
    """cudaHostRegister(buf, Portable | Mapped); returns the device address of buf."""
    assert buf.device.type == "cpu" and buf.is_contiguous()
    C = _cuda_ext()
    if C is not None:
        C.host_register(buf)
        return C.device_pointer(buf)
    cudart = torch.cuda.cudart()
    err = cudart.cudaHostRegister(buf.data_ptr(), buf.numel() * buf.element_size(), _PORTABLE | _MAPPED)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister failed: error {int(err)}")
    return buf.data_ptr()


def unregister(buf: torch.Tensor) -> None:
    C = _cuda_ext()
    if C is not None:
        C.host_unregister(buf)
        return
    err = torch.cuda.cudart().cudaHostUnregister(buf.data_ptr())
    if int(err) != 0:
        raise RuntimeError(f"cudaHostUnregister failed: error {int(err)}")
