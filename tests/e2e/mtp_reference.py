"""A plain HF-modules reference of a DeepSeek-V3 MTP (NextN) draft drafting a chain, independent of SGLang: what
it proposes at each verify pass of a greedy request, and so how many drafts each pass must accept
(tests/e2e/test_speculative.py's EAGLE server, v3-mtp's layer: tiny_model._add_mtp_layer).

The draft at position p reads the token after p and a hidden state: x_p = eh_proj([enorm(embed(token));
hnorm(h)]), then its decoder layer (attention over its own earlier positions, causal, rotary at position p; the
MLP's down projections are zero, checked, so the layer adds its attention only), then shared_head.norm, whose
output is both its hidden state and the input of the target's LM head. What SGLang 0.5.23's EAGLE worker (v2, the
overlap scheduler's) feeds it, read from speculative/eagle_worker_v2.py and eagle_worker_common.py:
- its extend passes (the prompt's, each chunk's, and the one after every verify, over the verify's window) give
  position p the target's final hidden state at p and the token after p, so once a pass is verified the draft's
  KV at every position the request keeps is that of the accepted sequence: x_p from HF's own h_p;
- a verify pass whose first position is f (the request's last token, not yet forwarded, at f) drafts d1 from the
  draft's output at f - 1 (the last extend position kept), then d2 and d3 from its decode steps at positions f
  and f + 1 (prepare_for_draft: positions from seq_lens = f, +1 a step), each reading the token drafted before it
  and the draft's own hidden state of the step before, attending positions 0 .. f - 1 and its own steps;
- the pass accepts its drafts while they are the greedy output's tokens at f + 1, f + 2, f + 3.
"""
import torch


class MTPDraft:
    """The MTP layer of checkpoint `path` in float32, with the target's embedding and LM head (`model`, HF's
    target model: SGLang's draft shares them, DeepseekV2ForCausalLM.set_embed_and_head)."""

    def __init__(self, path, model):
        import json
        import os

        from safetensors import safe_open
        from transformers import AutoConfig
        from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_v3

        cfg = AutoConfig.from_pretrained(path)
        cfg._attn_implementation = "eager"
        n = cfg.num_hidden_layers
        prefix = f"model.layers.{n}."
        with open(os.path.join(path, "model.safetensors.index.json")) as f:
            shards = {s for k, s in json.load(f)["weight_map"].items() if k.startswith(prefix)}
        w = {}
        for shard in shards:
            with safe_open(os.path.join(path, shard), framework="pt") as f:
                w.update({k[len(prefix):]: f.get_tensor(k).float() for k in f.keys() if k.startswith(prefix)})
        downs = [k for k in w if k.endswith("down_proj.weight")]
        assert downs and all(not w[k].any() for k in downs), "the reference leaves the MLP out: it must add nothing"
        self.attn = hf_v3.DeepseekV3Attention(cfg, layer_idx=n).float().eval()
        self.attn.load_state_dict({k[len("self_attn."):]: v for k, v in w.items() if k.startswith("self_attn.")})
        self.rope = hf_v3.DeepseekV3RotaryEmbedding(cfg)
        self.eps = cfg.rms_norm_eps
        self.w = w
        self.embed = model.model.embed_tokens.weight.detach().float()
        self.head = model.lm_head.weight.detach().float()

    def _norm(self, x, name):
        return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + self.eps) * self.w[name]

    def inputs(self, tokens, hidden):
        """x for each (token after the position, hidden state at it): [T, H]."""
        e = self._norm(self.embed[torch.as_tensor(tokens)], "enorm.weight")
        return torch.cat([e, self._norm(hidden, "hnorm.weight")], -1) @ self.w["eh_proj.weight"].T

    def layer(self, x):
        """The draft over positions 0 .. T-1 (causal): its hidden states (shared_head.norm's output) [T, H]."""
        T = x.shape[0]
        pos = torch.arange(T).unsqueeze(0)
        mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
        with torch.no_grad():
            a = self.attn(self._norm(x, "input_layernorm.weight")[None], self.rope(x[None], pos), mask)[0][0]
        return self._norm(x + a, "shared_head.norm.weight")

    def propose(self, s):
        return int((s @ self.head.T).argmax())

    def drafts(self, x, f, steps):
        """The chain a verify pass whose first position is f drafts, from the draft's inputs `x` of the accepted
        sequence (inputs()): d1 from the extend's output at f - 1, then each decode step at the next position."""
        s = self.layer(x[:f])[-1]
        chain, seq = [self.propose(s)], x[:f]
        while len(chain) < steps:
            seq = torch.cat([seq, self.inputs(chain[-1:], s[None])])
            s = self.layer(seq)[-1]
            chain.append(self.propose(s))
        return chain

    def judge(self, ids, target_hidden, prompt_len, accepted, steps):
        """[(first position, drafts accepted, what the reference accepts)] for the verify passes of a request
        whose tokens are `ids` (prompt and output) and whose passes accepted `accepted` (the record's steps),
        `steps` drafts a pass, from the target's final hidden states (`target_hidden` [>= len(ids) - 1, H]: HF's
        output_hidden_states[n]). Pass k's first position follows from the passes before it; only the passes whose
        drafts all fall inside `ids` are judged (SGLang may count drafts accepted past max_new_tokens)."""
        T = len(ids)
        x = self.inputs(ids[1:T], target_hidden[: T - 1].float())  # position p: (token p + 1, h_p)
        f, out = prompt_len, []
        for got in accepted:
            if f + steps >= T:
                break
            chain = self.drafts(x, f, steps)
            out.append((f, got, next((j for j in range(steps) if ids[f + 1 + j] != chain[j]), steps)))
            f += got + 1
        return out
