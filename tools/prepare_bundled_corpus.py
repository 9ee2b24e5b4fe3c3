"""Prepare the bundled Ding German-English corpus for fairseq: unpack, learn a joint sentencepiece BPE, encode.

    python tools/prepare_bundled_corpus.py --out work/data --vocab-size 8000

writes, in ``--out``: ``{train,valid,test}.{de,en}`` (plain text, the references for sacreBLEU),
``spm.model``/``spm.vocab`` (joint BPE learned on train) and ``{train,valid,test}.spm.{de,en}`` (the
BPE pieces, input of ``fairseq-preprocess``). Steps whose outputs exist are skipped, so a re-run is instant.
"""

import argparse
import gzip
import os
import sys

DEFAULT_CORPUS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                              "data", "ding-de-en")
SPLITS = ("train", "valid", "test")
LANGS = ("de", "en")


def unpack(corpus, out, max_test_lines=None):
    for split in SPLITS:
        for lang in LANGS:
            src, dst = os.path.join(corpus, f"{split}.{lang}.gz"), os.path.join(out, f"{split}.{lang}")
            if not os.path.isfile(src):
                raise SystemExit(f"prepare_bundled_corpus: {src} is missing; is --corpus the bundled data/ding-de-en?")
            if not os.path.exists(dst):
                with gzip.open(src, "rt", encoding="utf-8") as f:
                    lines = f.readlines()
                if split == "test" and max_test_lines:
                    lines = lines[:max_test_lines]
                with open(dst + ".tmp", "w", encoding="utf-8") as g:
                    g.writelines(lines)
                os.replace(dst + ".tmp", dst)


def learn_bpe(out, vocab_size):
    import sentencepiece as spm

    prefix = os.path.join(out, "spm")
    if os.path.exists(prefix + ".model"):
        return prefix + ".model"
    spm.SentencePieceTrainer.train(
        input=",".join(os.path.join(out, f"train.{lang}") for lang in LANGS),
        model_prefix=prefix + ".tmp",
        vocab_size=vocab_size,
        model_type="bpe",
        character_coverage=1.0,
        num_threads=2,
        # fairseq adds its own <s>, <pad>, </s>, <unk>: keep sentencepiece's ids out of its way
        bos_id=-1, eos_id=-1, pad_id=-1, unk_id=0,
        minloglevel=2,
    )
    for ext in ("model", "vocab"):
        os.replace(f"{prefix}.tmp.{ext}", f"{prefix}.{ext}")
    return prefix + ".model"


def encode(out, model):
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=model)
    for split in SPLITS:
        for lang in LANGS:
            dst = os.path.join(out, f"{split}.spm.{lang}")
            if os.path.exists(dst):
                continue
            with open(os.path.join(out, f"{split}.{lang}"), encoding="utf-8") as f:
                lines = [line.rstrip("\n") for line in f]
            with open(dst + ".tmp", "w", encoding="utf-8") as g:
                for pieces in sp.encode(lines, out_type=str):
                    g.write(" ".join(pieces) + "\n")
            os.replace(dst + ".tmp", dst)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--corpus", default=DEFAULT_CORPUS, help="directory of {split}.{de,en}.gz (default: bundled)")
    p.add_argument("--out", required=True)
    p.add_argument("--vocab-size", type=int, default=8000)
    p.add_argument("--max-test-lines", type=int, help="keep only the first N test sentences (quick checks)")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    unpack(args.corpus, args.out, args.max_test_lines)
    model = learn_bpe(args.out, args.vocab_size)
    encode(args.out, model)
    print(f"prepared {args.out} (joint sentencepiece BPE {args.vocab_size})")


if __name__ == "__main__":
    sys.exit(main())
