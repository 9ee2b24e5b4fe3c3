#!/usr/bin/env bash
# fairseq-ext quickstart: train and translate on the bundled German->English corpus, on CPU, in minutes.
#
#   bash examples/quickstart.sh [--arch NAME] [--minutes M] [--workdir DIR] [--direction de-en|en-de]
#
#   --arch       transformer (fairseq's own, default) or a model of this package; each arch's settings
#                live in examples/quickstart/<arch>.sh
#   --minutes    wall-clock training budget (default 6)
#   --workdir    where data, checkpoints and outputs go (default work/quickstart); a re-run reuses them
#   --smoke      a fast check that every step runs (20 updates, the first 100 test sentences, outputs cut at
#                16 tokens); used by the tests
#
# Steps: unpack the bundled corpus, learn a joint 8k sentencepiece BPE, fairseq-preprocess, fairseq-train
# with --user-dir fairseq_ext (progress bar), average the last checkpoints, fairseq-generate the test set and
# score it with sacreBLEU (detokenized, with its signature), then translate three sentences with
# fairseq-interactive. Each finished step leaves a marker, so a re-run skips it.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
ARCH=transformer
MINUTES=6
WORKDIR=""
DIRECTION=""
SMOKE=0
while [ $# -gt 0 ]; do
  case "$1" in
    --arch) ARCH="$2"; shift 2 ;;
    --minutes) MINUTES="$2"; shift 2 ;;
    --workdir) WORKDIR="$2"; shift 2 ;;
    --direction) DIRECTION="$2"; shift 2 ;;
    --smoke) SMOKE=1; shift ;;
    -h|--help) sed -n '2,18p' "$0"; exit 0 ;;
    *) echo "quickstart.sh: unknown option '$1' (see --help)" >&2; exit 2 ;;
  esac
done

ARCH_FILE="$ROOT/examples/quickstart/$ARCH.sh"
if [ ! -f "$ARCH_FILE" ]; then
  echo "quickstart.sh: no settings for --arch '$ARCH'; available: $(cd "$ROOT/examples/quickstart" && ls *.sh | sed 's/\.sh$//' | tr '\n' ' ')" >&2
  exit 2
fi
if [ -x "$ROOT/.venv/bin/python" ]; then
  export PATH="$ROOT/.venv/bin:$PATH"
elif ! python -c "import fairseq, fairseq_ext" >/dev/null 2>&1; then
  echo "quickstart.sh: no environment found; run 'bash install.sh' first" >&2
  exit 1
fi
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}" MKL_NUM_THREADS="${MKL_NUM_THREADS:-2}" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
cd "$ROOT"

# defaults an arch file may change
SRC=de; TGT=en
TASK=translation
TRAIN_ARGS=()
GEN_ARGS=(--beam 5 --lenpen 1.0)
AVERAGE_LAST=3
# shellcheck source=/dev/null
source "$ARCH_FILE"
if [ -n "$DIRECTION" ]; then SRC="${DIRECTION%-*}"; TGT="${DIRECTION#*-}"; fi
PREP_ARGS=()
if [ "$SMOKE" = 1 ]; then
  PREP_ARGS+=(--max-test-lines 100)
  GEN_ARGS+=(--max-len-a 0 --max-len-b 16)
fi

WORKDIR="${WORKDIR:-$ROOT/work/quickstart}"
DATA="$WORKDIR/data"
BIN="$WORKDIR/bin-$SRC-$TGT"
CKPT="$WORKDIR/checkpoints/$ARCH-$SRC-$TGT"
OUTDIR="$WORKDIR/out/$ARCH-$SRC-$TGT"
mkdir -p "$DATA" "$CKPT" "$OUTDIR"
step() { printf '\n==> [quickstart %s %s-%s] %s\n' "$ARCH" "$SRC" "$TGT" "$*"; }
# train_model BIN SAVE_DIR ARGS...: fairseq-train for --minutes (--smoke: 20 updates) with the quickstart's
# common options; arch files use it too (e.g. the SAT teacher)
train_model() {
  local bin="$1" save_dir="$2"; shift 2
  local budget=(--stop-time-hours "$(python -c "print($MINUTES / 60)")")
  if [ "$SMOKE" = 1 ]; then budget+=(--max-update 20); fi
  fairseq-train "$bin" --user-dir "$ROOT/fairseq_ext" --source-lang "$SRC" --target-lang "$TGT" \
    --save-dir "$save_dir" "${budget[@]}" --keep-last-epochs "$AVERAGE_LAST" \
    --no-save-optimizer-state --log-format tqdm --log-interval 50 --num-workers 0 --seed 1 "$@"
}
# average_last CKPT: CKPT/checkpoint_avg.pt = mean of the last AVERAGE_LAST epoch checkpoints
average_last() {
  local ckpt="$1" n
  n=$(ls "$ckpt" | grep -cE '^checkpoint[0-9]+\.pt$' || true)
  n=$(( n < AVERAGE_LAST ? n : AVERAGE_LAST ))
  if [ "$n" -ge 1 ]; then
    python -m fairseq_ext.average_checkpoints --inputs "$ckpt" --num-epoch-checkpoints "$n" \
      --output "$ckpt/checkpoint_avg.pt"
  else
    cp "$ckpt/checkpoint_last.pt" "$ckpt/checkpoint_avg.pt"
  fi
}
SECONDS=0

step "1/6 corpus and joint sentencepiece BPE (8k) in $DATA"
python tools/prepare_bundled_corpus.py --out "$DATA" --vocab-size 8000 "${PREP_ARGS[@]}"

if [ ! -f "$BIN/.done" ]; then
  step "2/6 fairseq-preprocess into $BIN"
  rm -rf "$BIN"
  fairseq-preprocess --source-lang "$SRC" --target-lang "$TGT" \
    --trainpref "$DATA/train.spm" --validpref "$DATA/valid.spm" --testpref "$DATA/test.spm" \
    --destdir "$BIN" --joined-dictionary --workers 2 > "$WORKDIR/preprocess-$SRC-$TGT.log"
  touch "$BIN/.done"
else
  step "2/6 binarised data already in $BIN"
fi

if declare -F arch_prepare >/dev/null; then arch_prepare; fi

if [ ! -f "$CKPT/.done" ]; then
  step "3/6 fairseq-train --arch $ARCH for at most $MINUTES minutes (checkpoints in $CKPT)"
  train_model "$BIN" "$CKPT" --task "$TASK" --arch "$ARCH" "${TRAIN_ARGS[@]}"
  touch "$CKPT/.done"
else
  step "3/6 model already trained in $CKPT (delete it to retrain)"
fi

step "4/6 average the last $AVERAGE_LAST epoch checkpoints"
average_last "$CKPT"

step "5/6 fairseq-generate the test set (${GEN_ARGS[*]}) and score with sacreBLEU"
fairseq-generate "$BIN" --user-dir "$ROOT/fairseq_ext" --task "$TASK" --source-lang "$SRC" --target-lang "$TGT" \
  --path "$CKPT/checkpoint_avg.pt" --gen-subset test --batch-size 64 --remove-bpe sentencepiece \
  --num-workers 0 "${GEN_ARGS[@]}" > "$OUTDIR/generate-test.txt"
grep -P '^D-[0-9]+\t' "$OUTDIR/generate-test.txt" | sed 's/^D-//' | sort -n -k1,1 | cut -f3 > "$OUTDIR/test.hyp"
sacrebleu "$DATA/test.$TGT" -i "$OUTDIR/test.hyp" -m bleu -w 2 | tee "$OUTDIR/bleu.json"

step "6/6 fairseq-interactive on three sentences"
if [ "$SRC" = de ]; then
  printf '%s\n' "Das Wetter ist heute sehr schön." "Ich habe keine Zeit für solche Fragen." "Er wohnt seit zehn Jahren in dieser Stadt."
else
  printf '%s\n' "The weather is very nice today." "I have no time for such questions." "He has lived in this town for ten years."
fi | fairseq-interactive "$BIN" --user-dir "$ROOT/fairseq_ext" --task "$TASK" --source-lang "$SRC" --target-lang "$TGT" \
  --path "$CKPT/checkpoint_avg.pt" --bpe sentencepiece --sentencepiece-model "$DATA/spm.model" \
  --num-workers 0 "${GEN_ARGS[@]}" 2>/dev/null | grep -P '^(S|D)-' | sed 's/^S-[0-9]*\t/source: /; s/^D-[0-9]*\t[^\t]*\t/   -> /'

step "done in ${SECONDS}s; outputs in $OUTDIR"
