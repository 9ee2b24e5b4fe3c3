#!/usr/bin/env bash
# ConvS2S on WMT'14 English->German (Gehring et al., 2017, Table 1: 25.16 BLEU with 15 layers), with fconv_glu.
#
#   bash recipes/convs2s/wmt14_en_de.sh [--workdir DIR] [--threads N] [--dry-run] [-- extra fairseq-train flags]
#
# Steps (each resumable; --dry-run prints the commands and touches nothing):
#   1. tools: mosesdecoder and subword-nmt (git clones)
#   2. download the WMT'14 training data of the paper (Europarl v7, Common Crawl, News Commentary v9; 4.5M
#      pairs) and newstest2014 (statmt.org), as fairseq's prepare-wmt14en2de.sh --icml17
#   3. prepare: normalise punctuation, remove non-printing characters, Moses-tokenise (-a), clean (1..250,
#      ratio 1.5); valid = every 100th training pair (not newstest2013); joint BPE with 40k merges (as the
#      paper)
#   4. fairseq-preprocess into $WORKDIR/data-bin with separate source and target dictionaries, every BPE type
#      kept (--thresholdsrc 0 --thresholdtgt 0), as fairseq's ConvS2S WMT'14 En-De recipe (fconv shares no
#      embeddings)
#   5. fairseq-train --arch fconv_glu_wmt_en_de (15 layers: 9x512, 4x1024, 2x2048 1x1): NAG, lr 0.5, clip-norm
#      0.1, dropout 0.2, label smoothing 0.1, max-tokens 4000, fixed lr annealed from epoch 50 (fairseq's
#      recipe of the paper's model; the paper trained on 8 GPUs: add --update-freq 8 on one)
#   6. fairseq-generate newstest2014 with beam 5, BPE removed, and BLEU with compound splitting (the usual
#      "tokenised BLEU" of WMT'14 En-De papers) via fairseq-score
# Needs internet for steps 1-2, perl, git, and GPUs for step 5 (days on one GPU).

source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
WORKDIR="$ROOT/work/convs2s-wmt14-en-de"
parse_args "$@"
ORIG="$WORKDIR/orig"; PREP="$WORKDIR/prep"; BIN="$WORKDIR/data-bin"; CKPT="$WORKDIR/checkpoints"
URLS="http://statmt.org/wmt13/training-parallel-europarl-v7.tgz http://statmt.org/wmt13/training-parallel-commoncrawl.tgz http://statmt.org/wmt14/training-parallel-nc-v9.tgz http://statmt.org/wmt14/test-full.tgz"
CORPORA="training/europarl-v7.de-en commoncrawl.de-en training/news-commentary-v9.de-en"

download() {
  sh "mkdir -p '$ORIG' && cd '$ORIG' && for u in $URLS; do f=\$(basename \$u); [ -f \$f ] || { wget -q \$u -O \$f.part && mv \$f.part \$f; }; tar zxf \$f; done"
}

prepare() {
  local M; M="$(MOSES_SCRIPTS)"; local B; B="$(BPE_TOOLS)"
  sh "mkdir -p '$PREP/tmp'"
  for l in en de; do
    sh "rm -f '$PREP/tmp/train.tags.$l' && for c in $CORPORA; do cat '$ORIG/'\$c.$l | perl '$M/tokenizer/normalize-punctuation.perl' $l | perl '$M/tokenizer/remove-non-printing-char.perl' | perl '$M/tokenizer/tokenizer.perl' -threads $THREADS -a -l $l >> '$PREP/tmp/train.tags.$l'; done"
    if [ "$l" = en ]; then t=src; else t=ref; fi
    sh "grep '<seg id' '$ORIG/test-full/newstest2014-deen-$t.$l.sgm' | sed -e 's/<seg id=\"[0-9]*\">\s*//g' -e 's/\s*<\/seg>\s*//g' -e \"s/’/'/g\" | perl '$M/tokenizer/tokenizer.perl' -threads $THREADS -a -l $l > '$PREP/tmp/test.$l'"
    sh "awk '{if (NR%100 == 0) print \$0; }' '$PREP/tmp/train.tags.$l' > '$PREP/tmp/valid.$l'"
    sh "awk '{if (NR%100 != 0) print \$0; }' '$PREP/tmp/train.tags.$l' > '$PREP/tmp/train.$l'"
  done
  sh "cat '$PREP/tmp/train.en' '$PREP/tmp/train.de' > '$PREP/tmp/train.de-en' && python '$B/learn_bpe.py' -s 40000 < '$PREP/tmp/train.de-en' > '$PREP/code'"
  for s in train valid test; do
    for l in en de; do
      sh "python '$B/apply_bpe.py' -c '$PREP/code' < '$PREP/tmp/$s.$l' > '$PREP/tmp/bpe.$s.$l'"
    done
  done
  sh "perl '$M/training/clean-corpus-n.perl' -ratio 1.5 '$PREP/tmp/bpe.train' en de '$PREP/train' 1 250"
  sh "perl '$M/training/clean-corpus-n.perl' -ratio 1.5 '$PREP/tmp/bpe.valid' en de '$PREP/valid' 1 250"
  sh "cp '$PREP/tmp/bpe.test.en' '$PREP/test.en' && cp '$PREP/tmp/bpe.test.de' '$PREP/test.de'"
}

binarize() {
  sh "fairseq-preprocess --source-lang en --target-lang de --trainpref '$PREP/train' --validpref '$PREP/valid' --testpref '$PREP/test' --destdir '$BIN' --thresholdsrc 0 --thresholdtgt 0 --workers $THREADS"
}

train() {
  sh "fairseq-train '$BIN' --user-dir '$USER_DIR' --arch fconv_glu_wmt_en_de --dropout 0.2 --criterion label_smoothed_cross_entropy --label-smoothing 0.1 --optimizer nag --clip-norm 0.1 --lr 0.5 --lr-scheduler fixed --force-anneal 50 --max-tokens 4000 --save-dir '$CKPT'$(extra_train_args)"
}

evaluate() {
  # compound splitting as fairseq's scripts/compound_split_bleu.sh: "a-b" -> "a ##AT##-##AT## b" on both sides
  sh "fairseq-generate '$BIN' --user-dir '$USER_DIR' --path '$CKPT/checkpoint_best.pt' --gen-subset test --batch-size 128 --beam 5 --remove-bpe > '$WORKDIR/generate-test.txt'"
  sh "grep ^H '$WORKDIR/generate-test.txt' | sort -V -k1,1 | cut -f3- | perl -ple 's{(\S)-(\S)}{\$1 ##AT##-##AT## \$2}g' > '$WORKDIR/test.hyp.split'"
  sh "grep ^T '$WORKDIR/generate-test.txt' | sort -V -k1,1 | cut -f2- | perl -ple 's{(\S)-(\S)}{\$1 ##AT##-##AT## \$2}g' > '$WORKDIR/test.ref.split'"
  sh "fairseq-score --sys '$WORKDIR/test.hyp.split' --ref '$WORKDIR/test.ref.split'"
}

step tools get_tools
step download download
step prepare prepare
step binarize binarize
step train train
step evaluate evaluate
