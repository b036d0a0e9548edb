"""Tokenizers built locally in real families' exact structure (no download), for detokenizer and protocol tests.

`sentencepiece_style_tokenizer`: what Llama 2's and Mistral's tokenizer.json hold: a BPE model with byte fallback
(<0x00>..<0xFF> at ids 3..258), the `▁` space marker prepended and substituted by the normalizer, a decoder that
turns `▁` back into spaces, fuses byte tokens, and strips one leading space; <s> prepended to every encoding.
Its vocabulary is trained on a small multilingual corpus, so words are several tokens and rarer characters fall
back to bytes.
"""
from __future__ import annotations

import json
import random

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

WORDS = ["hello", "world", "momentum", "the", "quick", "brown", "fox", "naïve", "café", "日本語", "Grüße", "tab\t",
         "line\r\n", "  indented", "emoji"]


def sentencepiece_style_tokenizer(vocab_size: int = 400, seed: int = 0) -> Tokenizer:
    rng = random.Random(seed)
    corpus = [" ".join(rng.choice(WORDS) for _ in range(12)) for _ in range(200)]
    normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    trained = Tokenizer(models.BPE(unk_token="<unk>"))
    trained.normalizer = normalizer
    trained.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="never")  # training only: pieces are `▁word`
    trained.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                                            special_tokens=["<unk>", "<s>", "</s>"]))
    state = json.loads(trained.to_str())["model"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece, _ in sorted(state["vocab"].items(), key=lambda kv: kv[1]):
        vocab.setdefault(piece, len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in state["merges"]]
    tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizer
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", 1)])
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    return tok


def sentencepiece_checkpoint(out_dir: str) -> str:
    """A tiny random Llama whose tokenizer is `sentencepiece_style_tokenizer` (<s> 1, </s> 2), as Llama 2's."""
    from inflight_backend.make_model import TinySpec, make_model

    tok = sentencepiece_style_tokenizer()
    make_model(out_dir, TinySpec(vocab_size=tok.get_vocab_size(), seed=5))
    tok.save(f"{out_dir}/tokenizer.json")
    with open(f"{out_dir}/config.json") as f:
        config = json.load(f)
    config.update(bos_token_id=1, eos_token_id=2)
    with open(f"{out_dir}/config.json", "w") as f:
        json.dump(config, f, indent=2)
    return out_dir
