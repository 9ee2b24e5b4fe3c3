#!/usr/bin/env bash
# SAT on WMT'14 English-German (the paper's Table 3): Transformer teacher, sequence-level distillation,
# SAT K=2/4/6 initialised from the teacher, BLEU with beam 4 and greedy, latency at batch size 1.
#
#   bash recipes/sat/wmt14_en_de.sh --data-bin DIR --text DIR [--workdir DIR] [--gpus N] [--dry-run]
#
#   --data-bin  binarised data of fairseq's examples/translation/prepare-wmt14en2de.sh (40k joint BPE; valid =
#               every 100th training pair, where the paper validates on newstest2013), preprocessed with
#               --joined-dictionary (default data-bin/wmt14_en_de)
#   --text      the BPE'd text it was binarised from (train.en, valid.*, test.*; default
#               examples/translation/wmt14_en_de)
#   --workdir   checkpoints, distilled data and results (default work/sat-wmt14)
#   --ks        group sizes (default "2 4 6")
#   --gpus      GPUs to train on (default 8; fairseq-train --distributed-world-size): the batch stays ~30k
#               tokens per update (--update-freq 8/N)
#   --dry-run   print every command of the pipeline without running anything
#
# Settings of the paper / the authors' configs (sa-nmt): base model with FFN 1024, shared embeddings, Adam
# 0.9/0.98 with eps 1e-9, label smoothing 0.1, ~100k updates of ~30k tokens (tokens_per_batch 30000: 8 GPUs x
# 3750 tokens), max length 150, average the last 5 checkpoints, beam 4 (lenpen 0.6) and greedy.
# Training drops pairs over 150 tokens; the distillation decode skips them too (--skip-invalid-size-...), and
# the test decodes lift the models' 150-position limit (sinusoidal positions) so that every test sentence
# is translated and scored.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
SRC=en; TGT=de
BIN="data-bin/wmt14_en_de"; TEXT="examples/translation/wmt14_en_de"; WORKDIR="work/sat-wmt14"
DRY_RUN=0; GPUS=8; KS=(2 4 6)
while [ $# -gt 0 ]; do
  case "$1" in
    --data-bin) BIN="$2"; shift 2 ;;
    --text) TEXT="$2"; shift 2 ;;
    --workdir) WORKDIR="$2"; shift 2 ;;
    --gpus) GPUS="$2"; shift 2 ;;
    --ks) read -r -a KS <<< "$2"; shift 2 ;;
    --dry-run) DRY_RUN=1; shift ;;
    -h|--help) sed -n '2,26p' "$0"; exit 0 ;;
    *) echo "wmt14_en_de.sh: unknown option '$1' (see --help)" >&2; exit 2 ;;
  esac
done
UPDATE_FREQ=$(( 8 / GPUS > 0 ? 8 / GPUS : 1 ))
COMMON=(--share-all-embeddings --encoder-ffn-embed-dim 1024 --decoder-ffn-embed-dim 1024
  --optimizer adam --adam-betas '(0.9, 0.98)' --adam-eps 1e-09 --clip-norm 0.0 --lr 0.0007 --lr-scheduler inverse_sqrt
  --warmup-updates 4000 --warmup-init-lr 1e-07 --dropout 0.1 --attention-dropout 0.0 --weight-decay 0.0
  --criterion label_smoothed_cross_entropy --label-smoothing 0.1 --max-tokens 3750 --update-freq "$UPDATE_FREQ" --distributed-world-size "$GPUS"
  --max-update 100000 --save-interval-updates 1000 --keep-interval-updates 5 --no-epoch-checkpoints
  --max-source-positions 150 --max-target-positions 150 --skip-invalid-size-inputs-valid-test --fp16)
TEACHER_ARCH=transformer_wmt_en_de; TEACHER_ARGS=("${COMMON[@]}")
SAT_ARCH=sat_transformer_wmt_en_de; SAT_ARGS=("${COMMON[@]}")
GEN_BEAM_ARGS=(--lenpen 0.6 --remove-bpe)
KD_ARGS=(--skip-invalid-size-inputs-valid-test)  # pairs over 150 tokens: not distilled (training drops them)
TEST_ARGS=(--model-overrides "{'max_source_positions': 1024, 'max_target_positions': 1024}")
BPE_FLAG=""
NUM_AVG=5; KD_BEAM=4
source "$ROOT/recipes/sat/pipeline.sh"
