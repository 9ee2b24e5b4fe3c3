#!/usr/bin/env bash
# ConvS2S (Gehring et al., 2017) on IWSLT'14 German->English with fconv_glu: fairseq's fconv_iwslt_de_en recipe
# (the paper itself has no IWSLT experiment).
#
#   bash recipes/convs2s/iwslt14_de_en.sh [--workdir DIR] [--threads N] [--dry-run] [-- extra fairseq-train flags]
#
# Steps (each resumable; --dry-run prints the commands and touches nothing):
#   1. tools: mosesdecoder (tokenizer, cleaning) and subword-nmt (BPE), git clones
#   2. download the IWSLT'14 de-en TED talks (fairseq's mirror of the WIT3 archive)
#   3. prepare as fairseq's examples/translation/prepare-iwslt14.sh: strip the XML, Moses-tokenise,
#      lowercase, clean (length 1..175, ratio 1.5); valid = every 23rd training pair; test = dev2010,
#      tst2010-2012 and TEDX dev2012; joint BPE with 10k merges
#   4. fairseq-preprocess into $WORKDIR/data-bin
#   5. fairseq-train --arch fconv_glu_iwslt_de_en: NAG, lr 0.25, clip-norm 0.1, dropout 0.2, max-tokens 4000;
#      the lr shrinks 10x whenever the validation loss stops improving, training stops below 1e-4 (paper §5)
#   6. fairseq-generate the test set with beam 5, BPE removed, and print BLEU (tokenised, lowercased, as
#      reported for IWSLT'14)
# Needs internet for steps 1-2, perl, git; a GPU for step 5 in reasonable time (CPU works, slowly).

source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
WORKDIR="$ROOT/work/convs2s-iwslt14-de-en"
parse_args "$@"
ORIG="$WORKDIR/orig"; PREP="$WORKDIR/prep"; BIN="$WORKDIR/data-bin"; CKPT="$WORKDIR/checkpoints"
URL="http://dl.fbaipublicfiles.com/fairseq/data/iwslt14/de-en.tgz"

download() {
  # an archive already there (an interrupted run, or put there by hand for an offline machine) is used as is
  sh "mkdir -p '$ORIG' && cd '$ORIG' && { [ -f de-en.tgz ] || { wget -q '$URL' -O de-en.tgz.part && mv de-en.tgz.part de-en.tgz; }; } && tar zxf de-en.tgz"
}

prepare() {
  local M; M="$(MOSES_SCRIPTS)"; local B; B="$(BPE_TOOLS)"
  sh "mkdir -p '$PREP/tmp'"
  for l in de en; do
    sh "grep -v -e '<url>' -e '<talkid>' -e '<keywords>' '$ORIG/de-en/train.tags.de-en.$l' | sed -e 's/<title>//g' -e 's/<\/title>//g' -e 's/<description>//g' -e 's/<\/description>//g' | perl '$M/tokenizer/tokenizer.perl' -threads $THREADS -l $l > '$PREP/tmp/train.tags.de-en.tok.$l'"
  done
  sh "perl '$M/training/clean-corpus-n.perl' -ratio 1.5 '$PREP/tmp/train.tags.de-en.tok' de en '$PREP/tmp/train.tags.de-en.clean' 1 175"
  for l in de en; do
    sh "perl '$M/tokenizer/lowercase.perl' < '$PREP/tmp/train.tags.de-en.clean.$l' > '$PREP/tmp/train.tags.de-en.$l'"
    sh "for o in '$ORIG'/de-en/IWSLT14.TED*.$l.xml; do f='$PREP/tmp/'\$(basename \$o .xml); grep '<seg id' \$o | sed -e 's/<seg id=\"[0-9]*\">\s*//g' -e 's/\s*<\/seg>\s*//g' -e \"s/’/'/g\" | perl '$M/tokenizer/tokenizer.perl' -threads $THREADS -l $l | perl '$M/tokenizer/lowercase.perl' > \$f; done"
    sh "awk '{if (NR%23 == 0) print \$0; }' '$PREP/tmp/train.tags.de-en.$l' > '$PREP/tmp/valid.$l'"
    sh "awk '{if (NR%23 != 0) print \$0; }' '$PREP/tmp/train.tags.de-en.$l' > '$PREP/tmp/train.$l'"
    sh "cat '$PREP'/tmp/IWSLT14.TED.dev2010.de-en.$l '$PREP'/tmp/IWSLT14.TEDX.dev2012.de-en.$l '$PREP'/tmp/IWSLT14.TED.tst2010.de-en.$l '$PREP'/tmp/IWSLT14.TED.tst2011.de-en.$l '$PREP'/tmp/IWSLT14.TED.tst2012.de-en.$l > '$PREP/tmp/test.$l'"
  done
  sh "cat '$PREP/tmp/train.de' '$PREP/tmp/train.en' > '$PREP/tmp/train.en-de' && python '$B/learn_bpe.py' -s 10000 < '$PREP/tmp/train.en-de' > '$PREP/code'"
  for s in train valid test; do
    for l in de en; do
      sh "python '$B/apply_bpe.py' -c '$PREP/code' < '$PREP/tmp/$s.$l' > '$PREP/$s.$l'"
    done
  done
}

binarize() {
  sh "fairseq-preprocess --source-lang de --target-lang en --trainpref '$PREP/train' --validpref '$PREP/valid' --testpref '$PREP/test' --destdir '$BIN' --workers $THREADS"
}

train() {
  sh "fairseq-train '$BIN' --user-dir '$USER_DIR' --arch fconv_glu_iwslt_de_en --optimizer nag --lr 0.25 --clip-norm 0.1 --dropout 0.2 --max-tokens 4000 --lr-scheduler reduce_lr_on_plateau --lr-shrink 0.1 --stop-min-lr 1e-4 --save-dir '$CKPT'$(extra_train_args)"
}

evaluate() {
  sh "fairseq-generate '$BIN' --user-dir '$USER_DIR' --path '$CKPT/checkpoint_best.pt' --gen-subset test --batch-size 128 --beam 5 --remove-bpe > '$WORKDIR/generate-test.txt' && tail -1 '$WORKDIR/generate-test.txt'"
}

step tools get_tools
step download download
step prepare prepare
step binarize binarize
step train train
step evaluate evaluate
