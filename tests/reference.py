"""Plain-torch references of sglang-hs kernels, shared by the CPU and GPU tests."""
import torch


def copy_rows_ref(aux, last, loc, store):
    """store[loc[t]] = [aux[t] split into K rows of H] (+ last[t]); padding rows (repeated slots) are
    written in row order, so the last one wins here (the kernel may leave any of them)."""
    S, P, H = store.shape
    rows = aux.reshape(aux.shape[0], -1, H)
    if last is not None:
        rows = torch.cat([rows, last[:, None, :]], dim=1)
    for t in range(rows.shape[0]):
        store[int(loc[t])] = rows[t]
    return store
