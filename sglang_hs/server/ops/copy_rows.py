"""Copy each forwarded row's captured hidden states to its KV-cache slot in the store.

    copy_rows(aux [T, K*H], last [T, H] | None, loc [T], store [S, P, H])
        store[loc[t], k, :] = aux[t, k*H:(k+1)*H]   for k < K
        store[loc[t], K, :] = last[t, :]            when last is given (P = K + 1; else P = K)

Three layers, Liger-Kernel style: the private `@triton.jit` kernel, `copy_rows` (the launcher, which
asserts the contract and takes its block sizes from `_launch_config`), and the capture code that calls
it. One launch per forward step, with no host synchronisation and no data-dependent shapes, so SGLang's
CUDA graphs capture it: `loc` is the graph's `out_cache_loc` input buffer and the store's address is
fixed, so each replay writes the new step's rows to the new step's slots. Graph padding rows point at
the padding slot, which no request reads; several of them may write it in the same launch.

Slots are checked on the device: a row whose slot lies outside [0, S) writes nothing at all (the C++
CPU op refuses such a call before writing; the kernel cannot stop a step without wrecking the CUDA
context, and the launcher cannot look at `loc` without synchronising) and is counted in a `SlotErrors` counter, read at a safe point outside
the forward by `SlotErrors.check()` (for a `HostStore`, `HostStore.check()`), which raises.

`store` is a tensor the kernel can address: on CUDA a device tensor (the staging strategy, with `loc`
the identity) or a `HostStore` over registered, mapped host memory (writing straight into /dev/shm);
on the CPU, only under TRITON_INTERPRET=1 (the tests), since the server's CPU path uses the C++ op.
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["num_slots"])
def _copy_rows_kernel(
    aux_ptr,
    last_ptr,
    loc_ptr,
    store_ptr,
    err_ptr,
    num_slots,
    aux_row_stride,
    last_row_stride,
    store_slot_stride,
    H: tl.constexpr,
    K: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    row = tl.program_id(0)
    part = tl.program_id(1)  # 0..K-1: an aux layer; K: the final state
    blk = tl.program_id(2)
    slot = tl.load(loc_ptr + row).to(tl.int64)
    ok = (slot >= 0) & (slot < num_slots)
    # A slot outside the store: no program of the row writes (or reads); its first program reports it.
    report = (~ok) & (part == 0) & (blk == 0)
    tl.atomic_add(err_ptr, 1, mask=report)
    tl.atomic_xchg(err_ptr + 1, slot, mask=report)
    tl.atomic_xchg(err_ptr + 2, num_slots.to(tl.int64), mask=report)
    slot = tl.where(ok, slot, 0)  # masked lanes keep an address inside the store
    offs = blk * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = (offs < H) & ok
    dst = store_ptr + slot * store_slot_stride + part * H + offs
    if part < K:
        vals = tl.load(aux_ptr + row.to(tl.int64) * aux_row_stride + part * H + offs, mask=mask)
    else:
        vals = tl.load(last_ptr + row.to(tl.int64) * last_row_stride + offs, mask=mask)
    tl.store(dst, vals, mask=mask)


def _launch_config(hidden: int, elem_size: int) -> Tuple[int, int]:
    """(BLOCK_H, num_warps): one program copies up to 8 KiB of a row part; 16-byte vectors per thread."""
    block = min(triton.next_power_of_2(hidden), max(16, 8192 // elem_size))
    num_warps = max(1, min(8, block * elem_size // (16 * 32)))
    return block, num_warps


class SlotErrors:
    """Rows the kernel dropped because their slot lay outside [0, S) of the store, counted on the device.

    `counts` = [rows dropped, the slot of one of them, that store's S], int64, written by the kernel with
    atomics and never reset: allocate it once, outside CUDA-graph capture (its address is baked into
    captured launches). Reading it synchronises, so do it at a safe point outside the forward.
    """

    def __init__(self, device) -> None:
        self.counts = torch.zeros(3, dtype=torch.int64, device=device)

    def read(self) -> Tuple[int, int, int]:
        """(rows dropped, one of their slots, the store's S). Synchronises with the device."""
        n, slot, S = self.counts.tolist()
        return n, slot, S

    def check(self) -> None:
        """Raise if any copy since this counter was made dropped a row. Synchronises with the device."""
        check_slot_errors(*self.read())


def check_slot_errors(n: int, slot: int, S: int) -> None:
    """Raise if a counter's values (SlotErrors.counts, read on the host) say a copy dropped a row."""
    if n:
        raise RuntimeError(
            f"sglang-hs: the capture copy dropped {n} row{'s' * (n != 1)} whose KV slot lay outside the "
            f"store's [0, {S}) (e.g. slot {slot}); nothing outside the store was written, but those tokens "
            "have no rows: the store must hold every KV-cache slot the server hands out")


_DEFAULT_ERRORS: Dict[torch.device, SlotErrors] = {}


def slot_errors(device) -> SlotErrors:
    """The counter of copies into plain-tensor stores on `device` that were given none of their own."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    errors = _DEFAULT_ERRORS.get(device)
    if errors is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "sglang-hs: the copy kernel's slot-error counter must be allocated outside CUDA-graph capture: "
                "run one copy eagerly first, or pass `errors=`")
        errors = _DEFAULT_ERRORS[device] = SlotErrors(device)
    return errors


class HostStore:
    """A store in host memory that the GPU can address (cudaHostRegister'ed with the Mapped flag).

    Triton takes any object with `data_ptr()` and `dtype`; this one carries the device address of the
    mapping and the shape the launcher checks. Keep `host` (the mapping) alive as long as this lives.
    Make it outside CUDA-graph capture: it allocates its slot-error counter (`errors`, read by `check`).
    """

    def __init__(self, host: torch.Tensor, device_ptr: int) -> None:
        self.host, self._ptr = host, int(device_ptr)
        self.dtype, self.shape = host.dtype, host.shape
        self.device = torch.device("cuda")
        self.errors = SlotErrors(self.device)
        self._rows = None

    def check(self) -> None:
        """Raise if a copy into this store dropped a row whose slot lay outside it (synchronises)."""
        self.errors.check()

    def data_ptr(self) -> int:
        return self._ptr

    def device_rows(self) -> torch.Tensor:
        """The store as a CUDA tensor of bytes, [S, one slot's bytes], over the mapping (zero copy: its reads
        and writes are the host memory's), for moving rows on the GPU in stream order. Made once."""
        if self._rows is None:
            row_bytes = self.host[0].numel() * self.host.element_size()
            mapped = type("MappedStore", (), {})()
            mapped.__cuda_array_interface__ = {"shape": (self.shape[0], row_bytes), "typestr": "|u1",
                                               "data": (self._ptr, False), "strides": None, "version": 3}
            self._rows = torch.as_tensor(mapped, device=self.device)
        return self._rows

    def stride(self, dim: int) -> int:
        return self.host.stride(dim)

    def dim(self) -> int:
        return self.host.dim()

    def is_contiguous(self) -> bool:
        return self.host.is_contiguous()


def copy_rows(aux: torch.Tensor, last: Optional[torch.Tensor], loc: torch.Tensor, store,
              errors: Optional[SlotErrors] = None) -> None:
    """Rows whose slot lies outside the store are dropped and counted in `errors` (by default the
    HostStore's own counter, or for a tensor store `slot_errors(aux.device)`)."""
    T = aux.shape[0]
    assert store.dim() == 3 and store.is_contiguous(), "store must be a contiguous [S, P, H] buffer"
    S, P, H = store.shape
    K = P - (last is not None)
    assert K >= 1 and aux.dim() == 2 and aux.shape[1] == K * H, (
        f"aux {tuple(aux.shape)} does not hold K={K} layers of H={H} for a store of {tuple(store.shape)}")
    assert aux.stride(1) == 1, "aux rows must be contiguous"
    assert aux.dtype == store.dtype, f"aux is {aux.dtype}, store is {store.dtype}"
    if last is not None:
        assert last.shape == (T, H) and last.stride(1) == 1 and last.dtype == store.dtype, (
            f"last {tuple(last.shape)} {last.dtype} does not match [T={T}, H={H}] {store.dtype}")
    assert loc.shape == (T,) and loc.dtype in (torch.int32, torch.int64), f"loc must be [T={T}] int32/int64"
    assert loc.device == aux.device, "loc and aux must be on the same device"
    if T == 0:
        return
    if errors is None:
        errors = store.errors if isinstance(store, HostStore) else slot_errors(aux.device)
    assert errors.counts.device == aux.device, f"slot-error counter on {errors.counts.device}, rows on {aux.device}"
    block, num_warps = _launch_config(H, aux.element_size())
    grid = (T, P, triton.cdiv(H, block))
    _copy_rows_kernel[grid](
        aux, last if last is not None else aux, loc, store, errors.counts, S,
        aux.stride(0), last.stride(0) if last is not None else 0, P * H,
        H=H, K=K, BLOCK_H=block, num_warps=num_warps,
    )
