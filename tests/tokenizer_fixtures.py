"""Tokenizers built locally in real families' exact structure (no download), for detokenizer and protocol tests.

`sentencepiece_style_tokenizer`: what Llama 2's and Mistral's tokenizer.json hold: a BPE model with byte fallback
(<0x00>..<0xFF> at ids 3..258), the `▁` space marker prepended and substituted by the normalizer, a decoder that
turns `▁` back into spaces, fuses byte tokens, and strips one leading space; <s> prepended to every encoding.
Its vocabulary is trained on a small multilingual corpus, so words are several tokens and rarer characters fall
back to bytes.

`byte_level_bpe_tokenizer`: what Llama 3's and Qwen2's tokenizer.json hold: text split by the family's regex,
each piece's UTF-8 bytes mapped to printable characters (GPT-2's byte-to-unicode table), BPE merges over those
(every byte is a token, so nothing is unknown), the ByteLevel decoder; Llama 3 prepends <|begin_of_text|> and
skips merges for whole-word vocabulary entries (`ignore_merges`), Qwen2 normalizes to NFC and adds no BOS.
`byte_level_checkpoint` writes either with its tokenizer_config.json (class, special tokens, chat template) and
generation_config.json as those checkpoints ship them.
"""
from __future__ import annotations

import json
import random

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

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


# The split patterns of Llama 3's and Qwen2's tokenizer.json (Qwen2 splits digits one by one).
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                  r"\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                 r"\s*[\r\n]+|\s+(?!\S)|\s+")
BYTE_LEVEL = {  # family: (pattern, special tokens (the first is BOS for Llama 3), NFC, BOS prepended)
    "llama3": (LLAMA3_PATTERN, ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                                "<|eot_id|>"], False, True),
    "qwen2": (QWEN2_PATTERN, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], True, False),
}
BYTE_CORPUS = WORDS + ["I'm", "don't", "we'll", "12345", "3.14159", "x = f(y) + 2;", "\n\n", "    return",
                       "привет", "مرحبا", "한국어", "👍🏽", "👨‍👩‍👧"]


def byte_level_bpe_tokenizer(family: str = "llama3", vocab_size: int = 700, seed: int = 0) -> Tokenizer:
    pattern, specials, nfc, bos = BYTE_LEVEL[family]
    rng = random.Random(seed)
    corpus = [" ".join(rng.choice(BYTE_CORPUS) for _ in range(12)) for _ in range(300)]
    tok = Tokenizer(models.BPE(ignore_merges=family == "llama3"))
    if nfc:
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.add_special_tokens(specials)
    byte_level = processors.ByteLevel(trim_offsets=False)
    if bos:
        tok.post_processor = processors.Sequence([byte_level, processors.TemplateProcessing(
            single=f"{specials[0]} $A", pair=f"{specials[0]} $A {specials[0]} $B",
            special_tokens=[(specials[0], tok.token_to_id(specials[0]))])])
    else:
        tok.post_processor = byte_level
    return tok


LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    " + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
QWEN2_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def byte_level_checkpoint(out_dir: str, family: str = "llama3", seed: int = 5) -> str:
    """A tiny random model with `byte_level_bpe_tokenizer(family)`: a Llama 3 (PreTrainedTokenizerFast, BOS,
    end ids <|end_of_text|> and <|eot_id|> in generation_config.json) or a Qwen2 written through transformers'
    Qwen2 classes (Qwen2Tokenizer, no BOS, end <|im_end|>)."""
    import os

    tok = byte_level_bpe_tokenizer(family)
    specials = BYTE_LEVEL[family][1]
    ids = {name: tok.token_to_id(name) for name in specials}
    os.makedirs(out_dir, exist_ok=True)
    if family == "llama3":
        from inflight_backend.make_model import TinySpec, make_model

        make_model(out_dir, TinySpec(vocab_size=tok.get_vocab_size(), seed=seed))
        config_updates = dict(bos_token_id=ids["<|begin_of_text|>"], eos_token_id=ids["<|end_of_text|>"])
        tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>",
                            "eos_token": "<|eot_id|>", "chat_template": LLAMA3_TEMPLATE}
        generation = {"bos_token_id": ids["<|begin_of_text|>"],
                      "eos_token_id": [ids["<|end_of_text|>"], ids["<|eot_id|>"]]}
    else:
        import torch
        import transformers

        config = transformers.Qwen2Config(vocab_size=tok.get_vocab_size(), hidden_size=128, intermediate_size=256,
                                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                          max_position_embeddings=1024, tie_word_embeddings=True,
                                          bos_token_id=None, eos_token_id=ids["<|im_end|>"])
        torch.manual_seed(seed)
        transformers.Qwen2ForCausalLM(config).save_pretrained(out_dir, safe_serialization=True)
        config_updates = {}
        tokenizer_config = {"tokenizer_class": "Qwen2Tokenizer", "bos_token": None, "eos_token": "<|im_end|>",
                            "pad_token": "<|endoftext|>", "unk_token": None, "add_prefix_space": False,
                            "chat_template": QWEN2_TEMPLATE}
        generation = {"eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]]}
    tok.save(f"{out_dir}/tokenizer.json")
    with open(f"{out_dir}/config.json") as f:
        config_json = json.load(f)
    config_json.update(config_updates)
    for name, values in (("config.json", config_json), ("tokenizer_config.json", tokenizer_config),
                         ("generation_config.json", generation)):
        with open(f"{out_dir}/{name}", "w") as f:
            json.dump(values, f, indent=2)
    return out_dir
