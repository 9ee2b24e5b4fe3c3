"""Sequence-level knowledge distillation for the SAT (Kim and Rush 2016; SAT paper Sec. 4.1): turn the
output of ``fairseq-generate --gen-subset train`` with the teacher into a parallel corpus (source: the
original training source, target: the teacher's best hypothesis), ready for ``fairseq-preprocess`` with
the teacher's dictionaries (``--srcdict``/``--tgtdict``).

    fairseq-generate BIN --path teacher.pt --gen-subset train --beam 4 ... > generate-train.txt
    python -m fairseq_ext.sat.distill --generate-output generate-train.txt \
        --source DATA/train.spm.de --out-prefix KD/train --source-lang de --target-lang en
    fairseq-preprocess --source-lang de --target-lang en --trainpref KD/train \
        --validpref DATA/valid.spm --testpref DATA/test.spm \
        --srcdict BIN/dict.de.txt --tgtdict BIN/dict.en.txt --destdir BIN_KD

Sentence ids of ``H-<id>`` lines are line numbers of the binarised split, i.e. of ``--source``. Without
``--remove-bpe`` the hypotheses are in the same subword units as the data. Pairs the teacher skipped
(e.g. too long) or left empty are dropped and counted.
"""

import argparse
import os
import sys

from fairseq_ext.common.errors import FairseqExtError, command


def read_hypotheses(path):
    hyps = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.startswith("H-"):
                parts = line.rstrip("\n").split("\t")
                idx = int(parts[0][2:])
                if idx not in hyps:  # the first H line of a sentence is its best hypothesis
                    hyps[idx] = parts[2] if len(parts) > 2 else ""
    return hyps


def distill(generate_output, source, out_prefix, source_lang, target_lang):
    for path, flag in ((generate_output, "--generate-output"), (source, "--source")):
        if not os.path.isfile(path):
            raise FairseqExtError(f"{flag} {path}: no such file")
    hyps = read_hypotheses(generate_output)
    if not hyps:
        raise FairseqExtError(f"--generate-output {generate_output}: no 'H-' lines (is it fairseq-generate output?)")
    with open(source, encoding="utf-8") as f:
        src_lines = [line.rstrip("\n") for line in f]
    if max(hyps) >= len(src_lines):
        raise FairseqExtError(
            f"--generate-output has sentence id {max(hyps)} but --source {source} has {len(src_lines)} lines; "
            f"give the source side of the split that was decoded")
    os.makedirs(os.path.dirname(os.path.abspath(out_prefix)), exist_ok=True)
    kept = dropped = 0
    with open(f"{out_prefix}.{source_lang}", "w", encoding="utf-8") as fs, \
            open(f"{out_prefix}.{target_lang}", "w", encoding="utf-8") as ft:
        for i, src in enumerate(src_lines):
            hyp = hyps.get(i, "").strip()
            if not hyp or not src.strip():
                dropped += 1
                continue
            fs.write(src + "\n")
            ft.write(hyp + "\n")
            kept += 1
    return kept, dropped


@command
def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m fairseq_ext.sat.distill", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--generate-output", required=True, help="stdout of fairseq-generate on the training split")
    p.add_argument("--source", required=True, help="source side of that split, one sentence per line")
    p.add_argument("--out-prefix", required=True, help="writes OUT_PREFIX.SRC and OUT_PREFIX.TGT")
    p.add_argument("--source-lang", required=True)
    p.add_argument("--target-lang", required=True)
    a = p.parse_args(argv)
    kept, dropped = distill(a.generate_output, a.source, a.out_prefix, a.source_lang, a.target_lang)
    print(f"distill: wrote {kept} distilled pairs to {a.out_prefix}.{{{a.source_lang},{a.target_lang}}}"
          f" ({dropped} dropped)")


if __name__ == "__main__":
    sys.exit(main())
