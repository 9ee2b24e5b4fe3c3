#!/usr/bin/env bash
# SAT on IWSLT'14 German-English: Transformer teacher (transformer_iwslt_de_en), sequence-level
# distillation, SAT K=2/4/6 (sat_transformer_iwslt_de_en) initialised from the teacher, BLEU with beam 4
# and greedy, latency at batch size 1. One GPU.
#
#   bash recipes/sat/iwslt14_de_en.sh --data-bin DIR --text DIR [--workdir DIR] [--ks "2 4 6"] [--dry-run]
#
#   --data-bin  binarised data of fairseq's examples/translation/prepare-iwslt14.sh, preprocessed with
#               --joined-dictionary (default data-bin/iwslt14.tokenized.de-en)
#   --text      the BPE'd text (default examples/translation/iwslt14.tokenized.de-en)
#   --workdir   default work/sat-iwslt14
#   --dry-run   print every command of the pipeline without running anything
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
SRC=de; TGT=en
BIN="data-bin/iwslt14.tokenized.de-en"; TEXT="examples/translation/iwslt14.tokenized.de-en"
WORKDIR="work/sat-iwslt14"; DRY_RUN=0; KS=(2 4 6)
while [ $# -gt 0 ]; do
  case "$1" in
    --data-bin) BIN="$2"; shift 2 ;;
    --text) TEXT="$2"; shift 2 ;;
    --workdir) WORKDIR="$2"; shift 2 ;;
    --ks) read -r -a KS <<< "$2"; shift 2 ;;
    --dry-run) DRY_RUN=1; shift ;;
    -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
    *) echo "iwslt14_de_en.sh: unknown option '$1' (see --help)" >&2; exit 2 ;;
  esac
done
COMMON=(--share-decoder-input-output-embed --optimizer adam --adam-betas '(0.9, 0.98)' --clip-norm 0.0
  --lr 5e-4 --lr-scheduler inverse_sqrt --warmup-updates 4000 --dropout 0.3 --weight-decay 0.0001
  --criterion label_smoothed_cross_entropy --label-smoothing 0.1 --max-tokens 4096 --max-update 60000
  --save-interval-updates 1000 --keep-interval-updates 5 --no-epoch-checkpoints)
TEACHER_ARCH=transformer_iwslt_de_en; TEACHER_ARGS=("${COMMON[@]}")
SAT_ARCH=sat_transformer_iwslt_de_en; SAT_ARGS=("${COMMON[@]}")
GEN_BEAM_ARGS=(--lenpen 1.0 --remove-bpe)
KD_ARGS=(); TEST_ARGS=()  # default max positions 1024: nothing to skip
BPE_FLAG=""
NUM_AVG=5; KD_BEAM=4
source "$ROOT/recipes/sat/pipeline.sh"
