"""Prepare a bundled German-English corpus for fairseq: unpack, learn a joint sentencepiece BPE, encode.

    python tools/prepare_bundled_corpus.py --corpus bible --out work/data --vocab-size 8000

``--corpus`` is ``ding`` (data/ding-de-en, the default), ``bible`` (data/bible-de-en) or the path of a directory
of ``{train,valid,test}.{de,en}.gz``. Writes, in ``--out``: ``{train,valid,test}.{de,en}`` (plain text, the
references for sacreBLEU), the extra references the corpus has (``{valid,test}.en-kjv``, ``.en-bbe`` from
``{valid,test}.en-kjv.gz`` ...: line-aligned, for multi-reference BLEU), ``spm.model``/``spm.vocab`` (joint BPE
learned on train) and ``{train,valid,test}.spm.{de,en}`` (the BPE pieces, input of ``fairseq-preprocess``).
Steps whose outputs exist are skipped, so a re-run is instant; a ``--out`` prepared from another corpus, BPE
size or ``--max-test-lines`` is refused rather than mixed.
"""

import argparse
import glob
import gzip
import os
import re
import sys

DATA_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data")
NAMED_CORPORA = {"ding": os.path.join(DATA_DIR, "ding-de-en"), "bible": os.path.join(DATA_DIR, "bible-de-en")}
DEFAULT_CORPUS = NAMED_CORPORA["ding"]
SPLITS = ("train", "valid", "test")
LANGS = ("de", "en")
_EXTRA_REF = re.compile(r"^(valid|test)\.(de|en)-([A-Za-z0-9_]+)\.gz$")


def resolve_corpus(corpus):
    """'ding' / 'bible' -> the bundled directory; anything else is a path."""
    return NAMED_CORPORA.get(corpus, corpus)


def extra_references(corpus):
    """[(split, 'en-kjv'), ...]: the line-aligned extra references a corpus directory has."""
    out = []
    for path in sorted(glob.glob(os.path.join(corpus, "*.gz"))):
        m = _EXTRA_REF.match(os.path.basename(path))
        if m:
            out.append((m.group(1), f"{m.group(2)}-{m.group(3)}"))
    return out


def _read_gz(path, max_lines=None):
    with gzip.open(path, "rt", encoding="utf-8") as f:
        lines = f.readlines()
    return lines[:max_lines] if max_lines else lines


def _first_line(path):
    with open(path, encoding="utf-8") as f:
        return f.readline()


def check_existing(corpus, out, vocab_size, max_test_lines):
    """Refuse an --out that holds another corpus, BPE size or test cut (its files would be reused)."""
    problems = []
    train_en = os.path.join(out, "train.en")
    if os.path.isfile(train_en):
        with gzip.open(os.path.join(corpus, "train.en.gz"), "rt", encoding="utf-8") as f:
            if f.readline() != _first_line(train_en):
                problems.append(f"its train.en is not the one of {corpus}")
    test_de = os.path.join(out, "test.de")
    if os.path.isfile(test_de) and not problems:
        with open(test_de, encoding="utf-8") as f:
            have = sum(1 for _ in f)
        want = len(_read_gz(os.path.join(corpus, "test.de.gz"), max_test_lines))
        if have != want:
            problems.append(f"its test set has {have} lines, not {want} (--max-test-lines)")
    vocab = os.path.join(out, "spm.vocab")
    if os.path.isfile(vocab):
        with open(vocab, encoding="utf-8") as f:
            have = sum(1 for _ in f)
        if have != vocab_size:
            problems.append(f"its BPE has {have} pieces, not --vocab-size {vocab_size}")
    if problems:
        raise SystemExit(f"prepare_bundled_corpus: {out} was prepared differently ({'; '.join(problems)}); "
                         "use another --out or delete it")


def unpack(corpus, out, max_test_lines=None):
    files = [(split, lang) for split in SPLITS for lang in LANGS] + extra_references(corpus)
    for split, lang in files:
        src, dst = os.path.join(corpus, f"{split}.{lang}.gz"), os.path.join(out, f"{split}.{lang}")
        if not os.path.isfile(src):
            raise SystemExit(f"prepare_bundled_corpus: {src} is missing; --corpus is ding, bible or a directory "
                             "of {train,valid,test}.{de,en}.gz")
        if not os.path.exists(dst):
            lines = _read_gz(src, max_test_lines if split == "test" else None)
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


def count_lines(path):
    with open(path, encoding="utf-8") as f:
        return sum(1 for _ in f)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--corpus", default="ding",
                   help="ding (data/ding-de-en, default), bible (data/bible-de-en) or a directory of "
                        "{train,valid,test}.{de,en}.gz")
    p.add_argument("--out", required=True)
    p.add_argument("--vocab-size", type=int, default=8000)
    p.add_argument("--max-test-lines", type=int, help="keep only the first N test sentences (quick checks)")
    args = p.parse_args(argv)
    corpus = resolve_corpus(args.corpus)
    if not os.path.isdir(corpus):
        raise SystemExit(f"prepare_bundled_corpus: --corpus '{args.corpus}' is neither ding, bible nor a directory")
    os.makedirs(args.out, exist_ok=True)
    check_existing(corpus, args.out, args.vocab_size, args.max_test_lines)
    unpack(corpus, args.out, args.max_test_lines)
    model = learn_bpe(args.out, args.vocab_size)
    encode(args.out, model)
    sizes = ", ".join(f"{s} {count_lines(os.path.join(args.out, f'{s}.de'))}" for s in SPLITS)
    refs = sorted({name for _, name in extra_references(corpus)})
    print(f"prepared {args.out} from {corpus}: {sizes} sentence pairs; joint sentencepiece BPE {args.vocab_size}"
          + (f"; extra references {', '.join(refs)}" if refs else ""))


if __name__ == "__main__":
    sys.exit(main())
