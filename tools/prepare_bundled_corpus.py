"""Prepare a bundled German-English corpus for fairseq: unpack, learn a joint sentencepiece BPE, encode.

    python tools/prepare_bundled_corpus.py --corpus bible --out work/data --vocab-size 8000

``--corpus`` is ``ding`` (data/ding-de-en, the default), ``bible`` (data/bible-de-en) or the path of a directory
of ``{train,valid,test}.{de,en}.gz``. Writes, in ``--out``: ``{train,valid,test}.{de,en}`` (plain text, the
references for sacreBLEU), the extra references the corpus has (``{valid,test}.en-kjv``, ``.en-bbe`` from
``{valid,test}.en-kjv.gz`` ...: line-aligned, for multi-reference BLEU), ``spm.model``/``spm.vocab`` (joint BPE
learned on train) and ``{train,valid,test}.spm.{de,en}`` (the BPE pieces, input of ``fairseq-preprocess``).
Steps whose outputs exist are skipped, so a re-run is instant; a ``--out`` prepared from another corpus, BPE
size or ``--max-test-lines`` is refused rather than mixed.

``--extra-train DIR [DIR ...]`` appends extra training data to the training split: each DIR (or the name
``ding-lexicon`` = data/ding-lexicon-de-en, ``libreoffice-help`` = data/libreoffice-help-de-en) holds
``train.{de,en}.gz``; their lines follow the corpus's own training lines in ``train.{de,en}`` in the order given,
so the BPE is learned on the combined training text. Valid and test stay the corpus's. The extra set is
recorded in ``--out``/``train.extra`` (name, lines, sha256 of each DIR's train.de.gz and train.en.gz), and a
``--out`` prepared with another extra set (or none) is refused::

    python tools/prepare_bundled_corpus.py --corpus ding --extra-train ding-lexicon libreoffice-help --out work/data

``--spm-model FILE`` encodes with a given sentencepiece model instead of learning one (a release checkpoint's
``spm.model``, releases/): FILE is copied to ``--out``/``spm.model``, and a ``--out`` that holds another model
is refused. ``--vocab-size`` is then ignored.
"""

import argparse
import glob
import gzip
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout, for tools.*
from tools.build_ding_corpus import sha256  # noqa: E402  (file hash)

DATA_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data")
NAMED_CORPORA = {"ding": os.path.join(DATA_DIR, "ding-de-en"), "bible": os.path.join(DATA_DIR, "bible-de-en")}
DEFAULT_CORPUS = NAMED_CORPORA["ding"]
SPLITS = ("train", "valid", "test")
LANGS = ("de", "en")
NAMED_EXTRA_TRAIN = {"ding-lexicon": os.path.join(DATA_DIR, "ding-lexicon-de-en"),
                     "libreoffice-help": os.path.join(DATA_DIR, "libreoffice-help-de-en")}
EXTRA_RECORD = "train.extra"
_EXTRA_REF = re.compile(r"^(valid|test)\.(de|en)-([A-Za-z0-9_]+)\.gz$")


def resolve_corpus(corpus):
    """'ding' / 'bible' -> the bundled directory; anything else is a path."""
    return NAMED_CORPORA.get(corpus, corpus)


def resolve_extra_train(extra):
    """'ding-lexicon' / 'libreoffice-help' -> the bundled directory; anything else is a path."""
    return NAMED_EXTRA_TRAIN.get(extra, extra)


def extra_train_record(extra_dirs):
    """The lines of train.extra for these extra training directories: name, line count, sha256 of the two files.
    Refuses a directory without train.{de,en}.gz or with files of different line counts."""
    record = []
    for d in extra_dirs:
        paths = [os.path.join(d, f"train.{lang}.gz") for lang in LANGS]
        for path in paths:
            if not os.path.isfile(path):
                raise SystemExit(f"prepare_bundled_corpus: {path} is missing; --extra-train takes ding-lexicon, "
                                 "libreoffice-help or directories of train.{de,en}.gz")
        counts = [len(_read_gz(path)) for path in paths]
        if counts[0] != counts[1]:
            raise SystemExit(f"prepare_bundled_corpus: {d}: train.de.gz has {counts[0]} lines, train.en.gz "
                             f"{counts[1]}")
        record.append("\t".join([os.path.basename(os.path.normpath(d)), str(counts[0])]
                                + [sha256(path) for path in paths]) + "\n")
    return record


def _describe_extra(record):
    """'ding-lexicon-de-en (374170 pairs), ...' for the lines of a train.extra."""
    return ", ".join("{} ({} pairs)".format(*line.split("\t")[:2]) for line in record) or "none"


def _recorded_extra(out):
    path = os.path.join(out, EXTRA_RECORD)
    if not os.path.isfile(path):
        return []
    with open(path, encoding="utf-8") as f:
        return f.readlines()


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


def check_existing(corpus, out, vocab_size, max_test_lines, extra_record=(), spm_model=None):
    """Refuse an --out that holds another corpus, BPE size (or --spm-model), test cut or extra training set (its
    files would be reused); extra_record: extra_train_record() of the --extra-train directories."""
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
    have_model = os.path.join(out, "spm.model")
    if spm_model is not None:
        if os.path.isfile(have_model) and sha256(have_model) != sha256(spm_model):
            problems.append(f"its spm.model is not --spm-model {spm_model}")
        elif not os.path.isfile(have_model) and os.path.isfile(vocab):
            problems.append("its BPE was learned, not given by --spm-model")
    elif os.path.isfile(have_model) and not os.path.isfile(vocab):
        problems.append("its BPE was given by --spm-model, not learned")
    elif os.path.isfile(vocab):
        with open(vocab, encoding="utf-8") as f:
            have = sum(1 for _ in f)
        if have != vocab_size:
            problems.append(f"its BPE has {have} pieces, not --vocab-size {vocab_size}")
    if os.path.isfile(train_en) and _recorded_extra(out) != list(extra_record):
        problems.append(f"its extra training data is {_describe_extra(_recorded_extra(out))}, not --extra-train "
                        f"{_describe_extra(extra_record)} (or their files changed)")
    if problems:
        raise SystemExit(f"prepare_bundled_corpus: {out} was prepared differently ({'; '.join(problems)}); "
                         "use another --out or delete it")


def unpack(corpus, out, max_test_lines=None, extra_train=(), extra_record=None):
    """Write the plain-text splits; extra_train: directories whose train.{de,en}.gz follow the training lines
    (their extra_train_record() goes to train.extra when the training files are written)."""
    record_path = os.path.join(out, EXTRA_RECORD)
    if not os.path.exists(os.path.join(out, "train.en")):
        if extra_train:
            with open(record_path, "w", encoding="utf-8") as g:
                g.writelines(extra_record if extra_record is not None else extra_train_record(extra_train))
        elif os.path.exists(record_path):
            os.remove(record_path)  # left by an interrupted run with --extra-train
    files = [(split, lang) for split in SPLITS for lang in LANGS] + extra_references(corpus)
    for split, lang in files:
        src, dst = os.path.join(corpus, f"{split}.{lang}.gz"), os.path.join(out, f"{split}.{lang}")
        if not os.path.isfile(src):
            raise SystemExit(f"prepare_bundled_corpus: {src} is missing; --corpus is ding, bible or a directory "
                             "of {train,valid,test}.{de,en}.gz")
        if not os.path.exists(dst):
            lines = _read_gz(src, max_test_lines if split == "test" else None)
            if split == "train":
                for d in extra_train:
                    lines += _read_gz(os.path.join(d, f"train.{lang}.gz"))
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


def copy_bpe(out, spm_model):
    """--spm-model: out/spm.model is a copy of the given model (no spm.vocab: nothing was learned here)."""
    import shutil

    dst = os.path.join(out, "spm.model")
    if not os.path.exists(dst):
        shutil.copyfile(spm_model, dst + ".tmp")
        os.replace(dst + ".tmp", dst)
    return dst


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
    p.add_argument("--extra-train", nargs="+", default=[], metavar="DIR",
                   help="extra training data appended to the training split: ding-lexicon "
                        "(data/ding-lexicon-de-en), libreoffice-help (data/libreoffice-help-de-en) or directories "
                        "of train.{de,en}.gz")
    p.add_argument("--spm-model", metavar="FILE",
                   help="encode with this sentencepiece model (e.g. a release's spm.model) instead of learning one")
    args = p.parse_args(argv)
    corpus = resolve_corpus(args.corpus)
    if not os.path.isdir(corpus):
        raise SystemExit(f"prepare_bundled_corpus: --corpus '{args.corpus}' is neither ding, bible nor a directory")
    extra_train = [resolve_extra_train(d) for d in args.extra_train]
    for d in extra_train:
        if not os.path.isdir(d):
            raise SystemExit(f"prepare_bundled_corpus: --extra-train '{d}' is neither ding-lexicon, libreoffice-help "
                             "nor a directory")
    if args.spm_model is not None and not os.path.isfile(args.spm_model):
        raise SystemExit(f"prepare_bundled_corpus: --spm-model {args.spm_model} does not exist")
    if args.spm_model is not None:
        import sentencepiece

        try:
            sentencepiece.SentencePieceProcessor(model_file=args.spm_model)
        except (RuntimeError, OSError) as e:
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
            raise SystemExit(f"prepare_bundled_corpus: --spm-model {args.spm_model} is not a sentencepiece model "
                             f"({first}); give the spm.model the data was encoded with") from None
    extra_record = extra_train_record(extra_train)
    os.makedirs(args.out, exist_ok=True)
    check_existing(corpus, args.out, args.vocab_size, args.max_test_lines, extra_record, args.spm_model)
    unpack(corpus, args.out, args.max_test_lines, extra_train, extra_record)
    if args.spm_model is not None:
        model = copy_bpe(args.out, args.spm_model)
        bpe = f"sentencepiece model {args.spm_model}"
    else:
        model = learn_bpe(args.out, args.vocab_size)
        bpe = f"joint sentencepiece BPE {args.vocab_size}"
    encode(args.out, model)
    sizes = ", ".join(f"{s} {count_lines(os.path.join(args.out, f'{s}.de'))}" for s in SPLITS)
    refs = sorted({name for _, name in extra_references(corpus)})
    print(f"prepared {args.out} from {corpus}: {sizes} sentence pairs; {bpe}"
          + (f"; extra references {', '.join(refs)}" if refs else "")
          + (f"; extra training data {_describe_extra(extra_record)}" if extra_record else ""))


if __name__ == "__main__":
    sys.exit(main())
