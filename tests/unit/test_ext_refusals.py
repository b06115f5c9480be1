"""Every refusal of the compiled extension (csrc/) raises a RuntimeError with its whole message, numbers
included, on the calling thread and on any other (the staging scatter thread, the finish worker).

Issue 49's first GPU run: the extension built there links libstdc++ statically (the CUDA image's g++ 13
does), and TORCH_CHECK's message formatting (std::ostringstream, compiled into the extension) crashed in
its numeric insertion: the finish worker's refusal of a bad slot id and the staging scatter's refusal of a
slot outside the store each killed the process with SIGSEGV instead of raising. Built the same way here
(-static-libstdc++), the old code raised "copy_rows_cpu: slot " and nothing after it. csrc/check.h now
formats every message with snprintf; scripts/gpu_check.sh runs this file against the build of that
machine's toolchain too."""
import os
import re
import threading

import pytest
import torch

from sglang_hs._ext import ExtensionNotBuilt, ext

try:
    C = ext()
except ExtensionNotBuilt as e:  # a failure under make test (strict skips)
    pytest.skip(f"the extension is not built: {e}", allow_module_level=True)

HERE = os.path.dirname(os.path.abspath(__file__))
BF16 = torch.bfloat16


def _copy_slot_outside():
    C.copy_rows_cpu(torch.zeros(3, 32, dtype=BF16), None, torch.tensor([1, 2, 99]), torch.zeros(8, 2, 16, dtype=BF16), 1)


def _copy_dtype():
    C.copy_rows_cpu(torch.zeros(3, 32), None, torch.tensor([1, 2, 3]), torch.zeros(8, 2, 16, dtype=BF16), 1)


def _copy_shape():
    C.copy_rows_cpu(torch.zeros(3, 30, dtype=BF16), None, torch.tensor([1, 2, 3]), torch.zeros(8, 2, 16, dtype=BF16), 1)


def _copy_last():
    C.copy_rows_cpu(torch.zeros(3, 16, dtype=BF16), torch.zeros(2, 16, dtype=BF16), torch.tensor([1, 2, 3]),
                    torch.zeros(8, 2, 16, dtype=BF16), 1)


def _gather_index_outside():
    C.gather_rows_cpu(torch.zeros(4096, 3, 5, dtype=BF16), torch.tensor([7, -1071529666], dtype=torch.int32),
                      torch.empty(2, 3, 5, dtype=BF16), 1)


def _gather_idx_dtype():
    C.gather_rows_cpu(torch.zeros(8, 4), torch.tensor([1.0, 2.0]), torch.empty(2, 4), 1)


def _gather_threads():
    C.gather_rows_cpu(torch.zeros(8, 4), None, torch.empty(8, 4), 0)


def _map_size(tmp):
    C.map_file(tmp, "f", 4096, True)
    C.map_file(tmp, "f", 8192, False)


def _map_missing(tmp):
    C.map_file(os.path.join(tmp, "nowhere"), "f", 64, False)


def _atomics_offset():
    C.load_acquire(torch.zeros(64, dtype=torch.uint8), 60)


REFUSALS = {
    "copy: slot outside": (_copy_slot_outside, r"^copy_rows_cpu: slot 99 of row 2 outside \[0, 8\)$"),
    "copy: dtype": (_copy_dtype, r"^copy_rows_cpu: aux is Float, store is BFloat16$"),
    "copy: shape": (_copy_shape, r"^copy_rows_cpu: aux \[3, 30\] does not hold K=2 layers of H=16 for a store of \[8, 2, 16\]$"),
    "copy: last": (_copy_last, r"^copy_rows_cpu: last \[2, 16\] does not match \[T=3, H=16\] BFloat16$"),
    "gather: index outside": (_gather_index_outside, r"^gather_rows_cpu: index -1071529666 of row 1 outside \[0, 4096\)$"),
    "gather: idx dtype": (_gather_idx_dtype, r"^gather_rows_cpu: idx must be a CPU \[T=2\] int32/int64 tensor, got \[2\] Float$"),
    "gather: threads": (_gather_threads, r"^gather_rows_cpu: num_threads must be >= 1, got 0$"),
    "map_file: size": (_map_size, r"^sglang_hs\.map_file: .*/f has 4096 bytes, expected 8192$"),
    "map_file: missing dir": (_map_missing, r"^cannot open dump folder .*/nowhere: No such file or directory \(errno 2\)$"),
    "atomics: offset": (_atomics_offset, r"^sglang_hs atomics: offset 60 outside a buffer of 64 bytes$"),
}


def _raise_on(where, fn):
    """fn's exception, raised on the calling thread or on a new one."""
    if where == "caller":
        with pytest.raises(RuntimeError) as info:
            fn()
        return info.value
    caught = []

    def run():
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - judged by the test
            caught.append(e)

    t = threading.Thread(target=run)
    t.start()
    t.join(60)
    assert not t.is_alive() and caught, "the call raised nothing on the thread"
    assert isinstance(caught[0], RuntimeError), repr(caught[0])
    return caught[0]


@pytest.mark.parametrize("where", ["caller", "thread"])
@pytest.mark.parametrize("name", list(REFUSALS))
def test_each_refusal_raises_its_whole_message(name, where, tmp_path):
    fn, message = REFUSALS[name]
    if fn.__code__.co_argcount:
        fn = (lambda f: lambda: f(str(tmp_path)))(fn)
    err = _raise_on(where, fn)
    assert len(str(err).splitlines()) == 1, str(err)
    assert re.search(message, str(err)), str(err)


def test_csrc_formats_no_message_with_streams():
    """The rule check.h gives, kept: no TORCH_CHECK (its message goes through std::ostringstream), no c10::str,
    no iostream in the extension's sources."""
    csrc = os.path.join(HERE, "..", "..", "csrc")
    offenders = []
    for name in sorted(os.listdir(csrc)):
        with open(os.path.join(csrc, name)) as f:
            for i, line in enumerate(f, 1):
                code = line.split("//")[0]
                if any(k in code for k in ("TORCH_CHECK", "c10::str", "std::ostringstream", "<sstream>", "<iostream>")):
                    offenders.append(f"csrc/{name}:{i}: {line.strip()}")
    assert not offenders, "\n".join(offenders)
