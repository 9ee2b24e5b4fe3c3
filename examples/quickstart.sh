#!/usr/bin/env bash
# fairseq-ext quickstart: train and translate German->English on a bundled corpus, on CPU, in minutes.
#
#   bash examples/quickstart.sh [--corpus bible|ding] [--arch NAME] [--from-scratch] [--max-update N]
#                               [--minutes M] [--workdir DIR] [--direction de-en|en-de] [--spm-model FILE] [--smoke]
#
#   --corpus      bible (default): 29k German-English Bible verse pairs (Elberfelder 1932 -> World English
#                 Bible), valid = John and 1-3 John, test = Acts, with the KJV and the Bible in Basic English as
#                 extra test references (data/bible-de-en); ding: 12.8k example sentences of the Ding dictionary
#   --arch        transformer (fairseq's own, default) or a model of this package: fconv_glu, msc_transformer,
#                 sat_transformer, bert_jam; each arch's settings live in examples/quickstart/<arch>.sh
#   --from-scratch  train from random weights; by default the model continues training from the release
#                 checkpoint of releases/CORPUS-SRC-TGT/ when there is one for the arch (trained by
#                 tools/train_release.py, checked against its sha256; the console says which)
#   --max-update  training length in updates (default: the arch's: from scratch sized for about 6 minutes on 2
#                 idle cores, from a release a short continuation)
#   --minutes     cap on the training wall-clock, a safety net for slow or busy machines (default 8)
#   --workdir     data, checkpoints, outputs and logs (default work/quickstart, work/quickstart-ding for
#                 --corpus ding); a re-run reuses what is there
#   --direction   de-en (default) or en-de
#   --spm-model   encode with this sentencepiece model instead of learning one (a release's uses its own)
#   --smoke       a fast check that every step runs (20 updates, the first 100 test sentences, outputs cut at
#                 16 tokens); used by the tests
#
# Steps: unpack the corpus and learn a joint sentencepiece BPE (or take the release's), fairseq-preprocess (with
# the release's dictionary), fairseq-train with
# --user-dir fairseq_ext, average the last checkpoints, fairseq-generate the test set and score it with sacreBLEU
# (detokenized, with its signature; multi-reference too where the corpus has extra references), then translate
# three sentences with fairseq-interactive. The console shows one line per step and the key figures; the full
# logs of every tool are in WORKDIR/logs. Each finished step leaves a marker, so a re-run skips it.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
ARCH=transformer
CORPUS=bible
MINUTES=8
MAX_UPDATE_OPT=""
WORKDIR=""
DIRECTION=""
SMOKE=0
FROM_SCRATCH=0
SPM_MODEL=""
while [ $# -gt 0 ]; do
  case "$1" in
    --arch) ARCH="$2"; shift 2 ;;
    --corpus) CORPUS="$2"; shift 2 ;;
    --minutes) MINUTES="$2"; shift 2 ;;
    --max-update) MAX_UPDATE_OPT="$2"; shift 2 ;;
    --workdir) WORKDIR="$2"; shift 2 ;;
    --direction) DIRECTION="$2"; shift 2 ;;
    --smoke) SMOKE=1; shift ;;
    --from-scratch) FROM_SCRATCH=1; shift ;;
    --spm-model) SPM_MODEL="$2"; shift 2 ;;
    -h|--help) awk 'NR > 1 && !/^#/ { exit } NR > 1' "$0"; exit 0 ;;  # the comment block above
    *) echo "quickstart.sh: unknown option '$1' (see --help)" >&2; exit 2 ;;
  esac
done

case "$CORPUS" in
  bible|ding) ;;
  *) echo "quickstart.sh: unknown --corpus '$CORPUS'; use bible or ding" >&2; exit 2 ;;
esac
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
# 2 threads; idle OpenMP threads sleep instead of spinning (OMP_WAIT_POLICY=PASSIVE): on a machine that runs
# anything else, spinning threads made training 5x and decoding 10x slower in our measurements
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}" MKL_NUM_THREADS="${MKL_NUM_THREADS:-2}"
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
cd "$ROOT"

# defaults an arch file may change (it sees $CORPUS)
SRC=de; TGT=en
TASK=translation
TRAIN_ARGS=()
GEN_ARGS=(--beam 5 --lenpen 1.0 --max-len-a 1.2 --max-len-b 10)
BPE_SIZE=8000        # joint sentencepiece BPE, shared by every arch of a work dir
MAX_UPDATE=1000      # training length; --max-update overrides
SAVE_EVERY=100       # a checkpoint every SAVE_EVERY updates (only the last AVERAGE_LAST are written)
AVERAGE_LAST=3       # step 4 averages the last AVERAGE_LAST checkpoints
# continuing from a release checkpoint (releases/): RELEASE_UPDATES updates (--max-update overrides), the
# learning rate warmed up to RELEASE_LR in RELEASE_WARMUP updates and decayed linearly to 0 at the last update
# (fresh optimizer state: a release has none); an arch file sets RELEASE_LR to about its lr at the release's end
RELEASE_UPDATES=600
RELEASE_LR=0.0005
RELEASE_WARMUP=50
EXTRA_REF_NAMES=(kjv bbe)  # extra references of the test set for multi-reference BLEU (target English)
REF_LABEL="WEB+KJV+BBE"
DEMO_DE=("Und der König sandte Boten in die Stadt und ließ das Volk versammeln."
         "Fürchtet euch nicht, denn der Herr ist mit euch."
         "Ich habe heute keine Zeit, aber morgen komme ich zu dir.")
DEMO_EN=("And the king sent messengers to the city and gathered the people."
         "Do not be afraid, for the Lord is with you."
         "I have no time today, but tomorrow I will come to you.")
if [ "$CORPUS" = ding ]; then
  EXTRA_REF_NAMES=() REF_LABEL="Ding"
  DEMO_DE=("Das Wetter ist heute sehr schön." "Ich habe keine Zeit für solche Fragen."
           "Er wohnt seit zehn Jahren in dieser Stadt.")
  DEMO_EN=("The weather is very nice today." "I have no time for such questions."
           "He has lived in this town for ten years.")
fi
# shellcheck source=/dev/null
source "$ARCH_FILE"
if [ -n "$DIRECTION" ]; then SRC="${DIRECTION%-*}"; TGT="${DIRECTION#*-}"; fi
RELEASE_DIR="$ROOT/releases/$CORPUS-$SRC-$TGT"
RELEASE_PT=""
SUFFIX=""
RELEASE_NAME="${RELEASE_NAME:-$ARCH}"  # the model's name in the release's manifest (an arch file may set it)
if [ "$FROM_SCRATCH" = 0 ] && [ -f "$RELEASE_DIR/MANIFEST.json" ]; then
  # the release's model path, empty when it has none for this arch
  if ! RELEASE_PT="$(python -m fairseq_ext.release verify --if-present --release-dir "$RELEASE_DIR" \
      --name "$RELEASE_NAME")"; then
    exit 1  # the one-line reason is on stderr
  fi
fi
if [ -n "$RELEASE_PT" ]; then
  SPM_MODEL="$RELEASE_DIR/spm.model"
  SUFFIX="-release"
  MAX_UPDATE="$RELEASE_UPDATES"
fi
if [ -n "$MAX_UPDATE_OPT" ]; then MAX_UPDATE="$MAX_UPDATE_OPT"; fi
if [ -n "$RELEASE_PT" ]; then
  SAVE_EVERY=$(( MAX_UPDATE / 6 > 0 ? MAX_UPDATE / 6 : 1 ))
  TRAIN_ARGS+=(--lr-scheduler polynomial_decay --lr "$RELEASE_LR" --warmup-updates "$RELEASE_WARMUP"
               --total-num-update "$MAX_UPDATE" --end-learning-rate 0)
fi
if [ "$TGT" != en ]; then  # the extra references are English
  EXTRA_REF_NAMES=()
  if [ "$CORPUS" = bible ]; then REF_LABEL="Elberfelder"; fi
fi
PREP_ARGS=()
if [ -n "$SPM_MODEL" ]; then PREP_ARGS+=(--spm-model "$SPM_MODEL"); fi
if [ "$SMOKE" = 1 ]; then
  PREP_ARGS+=(--max-test-lines 100)
  GEN_ARGS+=(--max-len-a 0 --max-len-b 16)
  MAX_UPDATE=20 SAVE_EVERY=5 AVERAGE_LAST=3
  TRAIN_ARGS+=(--max-valid-steps 2)
fi

if [ -z "$WORKDIR" ]; then
  WORKDIR="$ROOT/work/quickstart"
  if [ "$CORPUS" != bible ]; then WORKDIR="$WORKDIR-$CORPUS"; fi
fi
# a run from a release keeps its data (the release's BPE and dictionary), checkpoints and outputs apart
DATA="$WORKDIR/data$SUFFIX"
BIN="$WORKDIR/bin-$SRC-$TGT$SUFFIX"
CKPT="$WORKDIR/checkpoints/$ARCH-$SRC-$TGT$SUFFIX"
OUTDIR="$WORKDIR/out/$ARCH-$SRC-$TGT$SUFFIX"
LOGS="$WORKDIR/logs"
mkdir -p "$DATA" "$CKPT" "$OUTDIR" "$LOGS"

T_STEP=0
step() { T_STEP=$SECONDS; printf '==> %s\n' "$*"; }
say() { printf '      %s\n' "$*"; }
took() { printf '%ss' $(( SECONDS - T_STEP )); }
# quiet LOG CMD...: run CMD with all its output in LOG; on failure show the end of LOG and stop
quiet() {
  local log="$1"; shift
  if ! "$@" > "$log" 2>&1; then
    echo "quickstart.sh: '$1' failed; the end of $log:" >&2
    tail -n 25 "$log" >&2
    exit 1
  fi
}
# train_model BIN SAVE_DIR LOG ARGS...: fairseq-train for MAX_UPDATE updates (at most --minutes) with the
# quickstart's common options, a one-line progress view on the console and the full log in LOG; arch files
# use it too (e.g. the SAT teacher)
train_model() {
  local bin="$1" save_dir="$2" log="$3"; shift 3
  local first=$(( MAX_UPDATE - (AVERAGE_LAST - 1) * SAVE_EVERY ))
  if [ "$first" -lt 1 ]; then first=1; fi
  # checkpoints (and the validation that goes with each) only at the last AVERAGE_LAST save points
  fairseq-train "$bin" --user-dir "$ROOT/fairseq_ext" --source-lang "$SRC" --target-lang "$TGT" \
    --save-dir "$save_dir" --max-update "$MAX_UPDATE" --stop-time-hours "$(python -c "print($MINUTES / 60)")" \
    --save-interval-updates "$SAVE_EVERY" --keep-interval-updates "$AVERAGE_LAST" --validate-after-updates "$first" \
    --no-epoch-checkpoints --no-save-optimizer-state --log-format simple --log-interval 50 --num-workers 0 \
    --seed 1 "$@" 2>&1 | python "$ROOT/examples/quickstart/progress.py" --log "$log" --max-update "$MAX_UPDATE"
}
# average_last CKPT: CKPT/checkpoint_avg.pt = mean of the last AVERAGE_LAST update (or epoch) checkpoints
average_last() {
  local ckpt="$1" n kind=update
  n=$(ls "$ckpt" | grep -cE '^checkpoint_[0-9]+_[0-9]+\.pt$' || true)
  if [ "$n" -eq 0 ]; then
    kind=epoch
    n=$(ls "$ckpt" | grep -cE '^checkpoint[0-9]+\.pt$' || true)
  fi
  if [ "$n" -lt "$AVERAGE_LAST" ] && [ -f "$ckpt/checkpoint_last.pt" ]; then
    # fewer save points than asked for: the --minutes cap stopped training early, and checkpoint_last.pt (written
    # at the stop) is newer than all of them
    cp "$ckpt/checkpoint_last.pt" "$ckpt/checkpoint_avg.pt"
    say "training stopped before its last save points: $ckpt/checkpoint_avg.pt is checkpoint_last.pt"
    return
  fi
  n=$(( n < AVERAGE_LAST ? n : AVERAGE_LAST ))
  if [ "$n" -ge 1 ]; then
    quiet "$LOGS/average-$(basename "$ckpt").log" python -m fairseq_ext.average_checkpoints --inputs "$ckpt" \
      "--num-$kind-checkpoints" "$n" --output "$ckpt/checkpoint_avg.pt"
    say "averaged the last $n $kind checkpoints into $ckpt/checkpoint_avg.pt"
  else
    cp "$ckpt/checkpoint_last.pt" "$ckpt/checkpoint_avg.pt"
    say "one checkpoint only: $ckpt/checkpoint_avg.pt is checkpoint_last.pt"
  fi
}
# bleu_line JSON: "24.31  (nrefs:...)"
bleu_line() { python -c "import json, sys; d = json.load(open(sys.argv[1])); print(f\"{d['score']:.2f}  ({d['signature']})\")" "$1"; }
SECONDS=0

echo "quickstart: --arch $ARCH, $SRC->$TGT, --corpus $CORPUS; work dir $WORKDIR (logs in $LOGS)"
if [ -n "$RELEASE_PT" ]; then
  say "starting from the release checkpoint $RELEASE_PT: $(python -c "import json, sys; m = json.load(open(sys.argv[1]))['models'][sys.argv[2]]; print(m.get('summary') or f\"{m['num_updates']} updates\")" "$RELEASE_DIR/MANIFEST.json" "$RELEASE_NAME") (sha256 checked; --from-scratch trains from random weights)"
  step "1/6 corpus ($CORPUS) with the release's sentencepiece BPE"
else
  if [ "$FROM_SCRATCH" = 0 ]; then
    say "no release of $RELEASE_NAME in releases/$CORPUS-$SRC-$TGT: training from random weights"
  fi
  if [ -n "$SPM_MODEL" ]; then
    step "1/6 corpus ($CORPUS) with the sentencepiece model $SPM_MODEL"
  else
    step "1/6 corpus ($CORPUS) and joint sentencepiece BPE (${BPE_SIZE})"
  fi
fi
quiet "$LOGS/prepare.log" python tools/prepare_bundled_corpus.py --corpus "$CORPUS" --out "$DATA" \
  --vocab-size "$BPE_SIZE" "${PREP_ARGS[@]}"
say "$(sed -n 's/^prepared .* from \(.*\): \(.*\)$/\2 (\1)/p' "$LOGS/prepare.log")  [$(took)]"

if [ ! -f "$BIN/.done" ]; then
  step "2/6 fairseq-preprocess into $BIN"
  rm -rf "$BIN"
  DICT_ARGS=()
  if [ -n "$RELEASE_PT" ]; then DICT_ARGS=(--srcdict "$RELEASE_DIR/dict.txt"); fi
  quiet "$LOGS/preprocess-$SRC-$TGT$SUFFIX.log" fairseq-preprocess --source-lang "$SRC" --target-lang "$TGT" \
    --trainpref "$DATA/train.spm" --validpref "$DATA/valid.spm" --testpref "$DATA/test.spm" \
    --destdir "$BIN" --joined-dictionary --workers 2 "${DICT_ARGS[@]}"
  touch "$BIN/.done"
  say "joined dictionary of $(grep -oE "\[$SRC\] Dictionary: [0-9]+ types" "$LOGS/preprocess-$SRC-$TGT$SUFFIX.log" | head -n 1 | grep -oE '[0-9]+') types  [$(took)]"
else
  step "2/6 binarised data already in $BIN"
fi

if [ -n "$RELEASE_PT" ]; then
  if declare -F arch_prepare_release >/dev/null; then arch_prepare_release; fi
elif declare -F arch_prepare >/dev/null; then
  arch_prepare
fi

if [ ! -f "$CKPT/.done" ]; then
  if [ -n "$RELEASE_PT" ]; then
    step "3/6 fairseq-train --arch $ARCH: $MAX_UPDATE more updates from the release (at most $MINUTES minutes), checkpoints in $CKPT"
    TRAIN_ARGS+=(--finetune-from-model "$RELEASE_PT")
  else
    step "3/6 fairseq-train --arch $ARCH: $MAX_UPDATE updates (at most $MINUTES minutes), checkpoints in $CKPT"
  fi
  # named after the checkpoint directory: two SAT students (SAT_K) of one work directory keep apart
  train_model "$BIN" "$CKPT" "$LOGS/train-$(basename "$CKPT").log" --task "$TASK" --arch "$ARCH" "${TRAIN_ARGS[@]}"
  touch "$CKPT/.done"
else
  step "3/6 model already trained in $CKPT (delete it to retrain)"
fi

step "4/6 average the last $AVERAGE_LAST checkpoints"
average_last "$CKPT"

step "5/6 fairseq-generate the test set (${GEN_ARGS[*]}) and score it with sacreBLEU"
quiet "$LOGS/generate-test-$ARCH-$SRC-$TGT$SUFFIX.log" fairseq-generate "$BIN" --user-dir "$ROOT/fairseq_ext" \
  --task "$TASK" --source-lang "$SRC" --target-lang "$TGT" --path "$CKPT/checkpoint_avg.pt" --gen-subset test \
  --batch-size 64 --remove-bpe sentencepiece --num-workers 0 "${GEN_ARGS[@]}" \
  --results-path "$OUTDIR"
grep -P '^D-[0-9]+\t' "$OUTDIR/generate-test.txt" | sed 's/^D-//' | sort -n -k1,1 | cut -f3 > "$OUTDIR/test.hyp"
sacrebleu "$DATA/test.$TGT" -i "$OUTDIR/test.hyp" -m bleu -w 2 > "$OUTDIR/bleu.json"
say "test BLEU $(bleu_line "$OUTDIR/bleu.json"): reference ${REF_LABEL%%+*}"
EXTRA_REFS=()
for ref in "${EXTRA_REF_NAMES[@]}"; do
  if [ -f "$DATA/test.$TGT-$ref" ]; then EXTRA_REFS+=("$DATA/test.$TGT-$ref"); fi
done
if [ "${#EXTRA_REFS[@]}" -gt 0 ]; then
  sacrebleu "$DATA/test.$TGT" "${EXTRA_REFS[@]}" -i "$OUTDIR/test.hyp" -m bleu -w 2 > "$OUTDIR/bleu-multi.json"
  say "multi-reference BLEU $(bleu_line "$OUTDIR/bleu-multi.json"): references $REF_LABEL"
fi
say "hypotheses in $OUTDIR/test.hyp, scores in $OUTDIR/bleu*.json  [$(took)]"

step "6/6 fairseq-interactive on three sentences"
if [ "$SRC" = de ]; then DEMO=("${DEMO_DE[@]}"); else DEMO=("${DEMO_EN[@]}"); fi
printf '%s\n' "${DEMO[@]}" > "$OUTDIR/interactive.$SRC"
quiet "$LOGS/interactive-$ARCH-$SRC-$TGT$SUFFIX.log" fairseq-interactive "$BIN" --user-dir "$ROOT/fairseq_ext" \
  --task "$TASK" --source-lang "$SRC" --target-lang "$TGT" --path "$CKPT/checkpoint_avg.pt" --bpe sentencepiece \
  --sentencepiece-model "$DATA/spm.model" --num-workers 0 --input "$OUTDIR/interactive.$SRC" "${GEN_ARGS[@]}"
grep -P '^D-[0-9]+\t' "$LOGS/interactive-$ARCH-$SRC-$TGT$SUFFIX.log" | sed 's/^D-//' | sort -n -k1,1 | cut -f3 \
  > "$OUTDIR/interactive.$TGT"
paste -d '\n' <(sed 's/^/source: /' "$OUTDIR/interactive.$SRC") <(sed 's/^/   -> /' "$OUTDIR/interactive.$TGT") \
  | tee "$OUTDIR/interactive.txt"

step "done in $(( SECONDS / 60 ))m$(printf '%02d' $(( SECONDS % 60 )))s ($SECONDS s); outputs in $OUTDIR, logs in $LOGS"
