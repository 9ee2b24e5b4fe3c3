#!/usr/bin/env bash
# BERT-JAM on WMT'14 English->German with bert-large-uncased on the English side, three phases.
#
#   bash recipes/bert_jam/wmt14_en_de.sh [--dry-run] [--from-phase N]
#
# Inputs (environment variables, defaults in brackets):
#   TEXT  [data/wmt14_en_de]       Moses-tokenised, BPE'd text (train/valid/test.{en,de}), e.g. from fairseq's
#         examples/translation/prepare-wmt14en2de.sh (40k joint BPE merges; the paper states no BPE size)
#   BIN   [data-bin/wmt14_en_de]   fairseq-preprocess --joined-dictionary of TEXT
#   BERT  [bert-large-uncased]     local directory of bert-large-uncased
#   SAVE  [checkpoints/bert_jam_wmt14_en_de]
# The paper: d_model 1024, d_ff 4096, 16 heads, 4k tokens per GPU x 4 GPUs with gradients accumulated over 32
# iterations (128 simulated GPUs: --update-freq 32 on 4 GPUs; use 128 / number of GPUs); beam 4, length
# penalty 0.6, BLEU after compound splitting.
SRC=en; TGT=de
ARCH=bert_jam_wmt_en_de_big
TEXT="${TEXT:-data/wmt14_en_de}"
BIN="${BIN:-data-bin/wmt14_en_de}"
BERT="${BERT:-bert-large-uncased}"
SAVE="${SAVE:-checkpoints/bert_jam_wmt14_en_de}"
PHASE1_EPOCHS=40; PHASE2_EPOCHS=50; PHASE3_EPOCHS=60
UPDATE_FREQ="${UPDATE_FREQ:-32}"
GEN_ARGS=(--beam 4 --lenpen 0.6)
COMPOUND_SPLIT=1
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
