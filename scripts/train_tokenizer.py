"""Train the embedded tiny model's tokenizer (byte-level BPE) on text this repo ships.

    python scripts/train_tokenizer.py      # rewrites sglang_hs/data/tiny_deepseek_v3/tokenizer.json

Deterministic: the same corpus gives the same tokenizer.json. The special tokens and the chat template
follow DeepSeek-V3's (same strings, same shape of template), so chat rendering and loss masks are
exercised the way they are on the real model.
"""
import json
import os

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "sglang_hs", "data")
OUT = os.path.join(DATA, "tiny_deepseek_v3")
SPECIAL = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<｜pad｜>"]
VOCAB_SIZE = 1024  # == config.json vocab_size; the trained vocabulary may come out smaller


def corpus():
    with open(os.path.join(DATA, "corpus.txt"), encoding="utf-8") as f:
        text = f.read()
    return [p for p in text.split("\n\n") if p.strip()]


def main():
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    assert tok.get_vocab_size() <= VOCAB_SIZE, tok.get_vocab_size()
    assert [tok.token_to_id(s) for s in SPECIAL] == list(range(len(SPECIAL)))
    tok.save(os.path.join(OUT, "tokenizer.json"))
    print(f"vocabulary: {tok.get_vocab_size()} tokens -> {OUT}/tokenizer.json")


if __name__ == "__main__":
    main()
