#!/usr/bin/env bash
# BERT-JAM on IWSLT'14 German->English (paper: 36.85 BLEU after phase 1, 38.66 after phase 3), three phases.
#
#   bash recipes/bert_jam/iwslt14_de_en.sh [--dry-run] [--from-phase N]
#
# Inputs (environment variables, defaults in brackets):
#   TEXT  [data/iwslt14.tokenized.de-en]   Moses-tokenised, BPE'd text (train/valid/test.{de,en}), e.g. from
#         fairseq's examples/translation/prepare-iwslt14.sh (10k joint BPE)
#   BIN   [data-bin/iwslt14.tokenized.de-en]  fairseq-preprocess --joined-dictionary of TEXT
#   BERT  [bert-base-german-dbmdz-uncased]    local directory of the German BERT (config.json, weights, vocab)
#   SAVE  [checkpoints/bert_jam_iwslt14_de_en]
# The paper's schedule: phase 1 to epoch 40, phase 2 to 50, phase 3 to 60 (the paper stops phase 3 on validation loss; here it runs
# all 10 epochs, which step 4 averages);
# average the last 10 epochs; beam 5, length penalty 1, tokenised BLEU.
SRC=de; TGT=en
ARCH=bert_jam_iwslt_de_en
TEXT="${TEXT:-data/iwslt14.tokenized.de-en}"
BIN="${BIN:-data-bin/iwslt14.tokenized.de-en}"
BERT="${BERT:-bert-base-german-dbmdz-uncased}"
SAVE="${SAVE:-checkpoints/bert_jam_iwslt14_de_en}"
PHASE1_EPOCHS=40; PHASE2_EPOCHS=50; PHASE3_EPOCHS=60
UPDATE_FREQ=1
GEN_ARGS=(--beam 5 --lenpen 1.0)
COMPOUND_SPLIT=0
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
