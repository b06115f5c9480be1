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


def hc_rows_ref(hidden_states, layers, streams="mean"):
    """The rows a DeepSeek-V4 capture holds for layer ids `layers`, from HF's `output_hidden_states` of one
    sequence (entry i < n: [T, hc_mult, H], the streams entering layer i): [T, K, H] of the streams' mean,
    or [T, K * hc_mult, H] of every stream (stream s of the k-th id at row k * hc_mult + s)."""
    per = [hidden_states[i] for i in layers]
    if streams == "mean":
        return torch.stack([h.mean(dim=-2) for h in per], dim=1)
    return torch.cat(per, dim=1)
