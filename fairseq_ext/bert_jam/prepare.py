"""Write the BERT input of ``--task translation_bert`` once, beside the binarised data.

    python -m fairseq_ext.bert_jam.prepare DATA_BIN --source-lang en --target-lang de \\
        --bert-model-name /path/to/bert [--splits train valid test]

For every split it reads the source text given to fairseq-preprocess (``--trainpref``/``--validpref``/
``--testpref``, the same values: ``{pref}.{src}``; recommended) or else fairseq's binarised source
(``{split}.{src}-{tgt}.{src}``; words outside the dictionary then reach BERT as its unknown token), turns each
sentence into plain text (BPE removed, detokenised: see ``--bert-remove-bpe`` / ``--bert-detokenize``), tokenises it
with the BERT tokenizer and its special tokens, truncates it to the model's limit (with a warning) and writes
the ids to ``{split}.{src}-{tgt}.{src}.bert.{bin,idx}``, plus ``bert_input.{src}.json`` (tokenizer, pad id,
settings). The model derives exactly the same ids from ``src_tokens`` when a batch has none (one-line
``fairseq-interactive`` input), because both use :class:`fairseq_ext.bert_jam.bert.BertInputBuilder`.
"""

import argparse
import json
import logging
import os
import sys

import torch

logger = logging.getLogger("fairseq_ext.bert_jam.prepare")
if not logger.handlers:  # progress on stdout whatever fairseq configured for the root logger
    _handler = logging.StreamHandler(sys.stdout)
    _handler.setFormatter(logging.Formatter("%(asctime)s | %(levelname)s | %(name)s | %(message)s"))
    logger.addHandler(_handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


def get_parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("data", help="fairseq-preprocess --destdir")
    p.add_argument("--source-lang", "-s", required=True)
    p.add_argument("--target-lang", "-t", required=True)
    p.add_argument("--bert-model-name", required=True, help="local BERT-architecture model directory")
    for name in ("train", "valid", "test"):
        p.add_argument(f"--{name}pref", default=None, metavar="FP",
                       help=f"the {name} text prefix given to fairseq-preprocess (comma-separated for several)")
    p.add_argument("--splits", nargs="+", default=None,
                   help="splits to prepare (default: every train*/valid*/test* split found)")
    p.add_argument("--bert-remove-bpe", default="auto", choices=["auto", "sentencepiece", "subword_nmt", "none"])
    p.add_argument("--bert-detokenize", default="auto", choices=["auto", "moses", "none"])
    p.add_argument("--bert-max-length", type=int, default=0, help="0: the model's limit")
    p.add_argument("--batch-size", type=int, default=2000, help="sentences tokenised at once")
    return p


def find_splits(data, src, tgt):
    out = []
    for name in sorted(os.listdir(data)):
        for a, b in ((src, tgt), (tgt, src)):
            suffix = f".{a}-{b}.{src}.idx"
            if name.endswith(suffix):
                out.append(name[: -len(suffix)])
    return sorted(set(out))


def main(argv=None):
    args = get_parser().parse_args(argv)
    from fairseq.data import Dictionary, data_utils, indexed_dataset

    from fairseq_ext.common.errors import FairseqExtError
    from fairseq_ext.bert_jam.bert import BertInputBuilder
    from fairseq_ext.bert_jam.task import META_NAME, bert_input_prefix

    src, tgt = args.source_lang, args.target_lang
    dict_path = os.path.join(args.data, f"dict.{src}.txt")
    if not os.path.isfile(dict_path):
        raise FairseqExtError(f"{dict_path} not found: DATA must be a fairseq-preprocess --destdir with "
                              f"--source-lang {src}")
    src_dict = Dictionary.load(dict_path)
    builder = BertInputBuilder(args.bert_model_name, src_dict, args.bert_remove_bpe, args.bert_detokenize,
                               args.bert_max_length)
    text_files = {}
    for name in ("train", "valid", "test"):
        prefs = getattr(args, f"{name}pref")
        for k, pref in enumerate(prefs.split(",") if prefs else []):
            text_files[name + (str(k) if k > 0 else "")] = f"{pref}.{src}"
    splits = args.splits or find_splits(args.data, src, tgt)
    if not splits:
        raise FairseqExtError(f"no binarised {src}-{tgt} source data in {args.data}")
    for split in splits:
        prefix = bert_input_prefix(args.data, split, src, tgt)
        source = data_utils.load_indexed_dataset(prefix[: -len(".bert")], src_dict, None)
        if source is None:
            raise FairseqExtError(f"--splits {split}: {prefix[:-len('.bert')]}.{{bin,idx}} not found in {args.data}")
        if split in text_files:
            path = text_files[split]
            if not os.path.isfile(path):
                raise FairseqExtError(f"--{split.rstrip('0123456789')}pref: {path} not found")
            with open(path, encoding="utf-8") as f:
                lines = [line.rstrip("\n") for line in f]
            if len(lines) != len(source):
                raise FairseqExtError(f"{path} has {len(lines)} lines but the binarised {split} source has "
                                      f"{len(source)}: give the prefix that fairseq-preprocess binarised")
            texts_of = lambda a, b: [builder.plain_text(x) for x in lines[a:b]]  # noqa: E731
        else:
            n_unk = sum(int(source[i].eq(src_dict.unk()).sum()) for i in range(len(source)))
            if n_unk:
                logger.warning(f"{split}: {n_unk} source tokens are {src_dict.unk_word} in the binarised data and "
                               f"reach BERT as {builder.tokenizer.unk_token}; pass --{split.rstrip('0123456789')}"
                               "pref (the text given to fairseq-preprocess) to give BERT the full sentence")
            texts_of = lambda a, b: [builder.text_from_source(source[i]) for i in range(a, b)]  # noqa: E731
        builder_out = indexed_dataset.make_builder(prefix + ".bin", impl="mmap", vocab_size=len(builder.tokenizer))
        n, n_tok = 0, 0
        for start in range(0, len(source), args.batch_size):
            texts = texts_of(start, min(start + args.batch_size, len(source)))
            for ids in builder.encode(texts):
                builder_out.add_item(torch.IntTensor(ids))
                n += 1
                n_tok += len(ids)
        builder_out.finalize(prefix + ".idx")
        logger.info(f"{split}: {n} sentences, {n_tok} BERT tokens -> {prefix}.{{bin,idx}} "
                    f"(from {text_files.get(split, 'the binarised source')}; e.g. '{texts_of(0, 1)[0]}')")
    meta = builder.meta()
    meta["n_truncated"] = builder.n_truncated
    with open(os.path.join(args.data, META_NAME.format(lang=src)), "w") as f:
        json.dump(meta, f, indent=1)
    logger.info(f"settings in {os.path.join(args.data, META_NAME.format(lang=src))}: {meta}")


if __name__ == "__main__":
    main()
