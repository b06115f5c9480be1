"""Attention of each request's new tokens over its KV slots under a mask, in plain torch, on SGLang's pools:
the CPU engine's paths its torch_native backend lacks (DSA's sparse selection, a speculative verify's tree)."""
from __future__ import annotations


def masked_attention(backend, q, k, v, layer, forward_batch, save_kv_cache, spans):
    """Write the step's KV as upstream does, then for each (request pool index, keys, query rows, mask) of
    `spans` (mask(length) -> [rows, length] bool, built lazily on the query's device) attend those query rows
    over req_to_token[request, :keys] with scaled_dot_product_attention. q [T, heads * qk] -> [T, heads * v]."""
    from sglang.srt.mem_cache.memory_pool import KVWriteLoc
    from torch.nn.functional import scaled_dot_product_attention

    pool = backend.token_to_kv_pool
    if save_kv_cache and k is not None and v is not None:
        pool.set_kv_buffer(layer, KVWriteLoc(forward_batch.out_cache_loc, backend.swa_out_cache_loc), k, v)
    q = q.reshape(-1, layer.tp_q_head_num, layer.qk_head_dim)
    o = q.new_zeros((q.shape[0], layer.tp_q_head_num, layer.v_head_dim))  # rows no span covers (padding): zeros
    k_cache, v_cache = pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id)
    req_to_token = backend.req_to_token_pool.req_to_token
    for req, length, rows, mask in spans:
        tokens = req_to_token[req, :length].long()
        key, value = k_cache[tokens].to(q.dtype), v_cache[tokens].to(q.dtype)  # [length, kv heads, dim]
        o[rows] = scaled_dot_product_attention(
            q[rows].transpose(0, 1).unsqueeze(0), key.transpose(0, 1).unsqueeze(0),
            value.transpose(0, 1).unsqueeze(0), attn_mask=mask(length).to(q.device), scale=layer.scaling,
            enable_gqa=layer.tp_q_head_num != layer.tp_k_head_num,
        )[0].transpose(0, 1)
    return o.reshape(-1, layer.tp_q_head_num * layer.v_head_dim)
