# Shared by recipes/bert_jam/*.sh: BERT-JAM's three-phase optimisation (Zhang et al. 2020, Section 2.4 and
# 3.2; official README), checkpoint averaging of the last 10 epochs and scoring. Sourced after a recipe has set
#   SRC TGT ARCH BERT BIN TEXT SAVE  PHASE1_EPOCHS PHASE2_EPOCHS PHASE3_EPOCHS  UPDATE_FREQ
#   GEN_ARGS (array)  COMPOUND_SPLIT (0/1)
# and optionally BERT_FEATURE_CACHE=DIR (environment): phases 1 and 2 train on BERT features computed once
# (--bert-feature-cache DIR/phase1: B_L only; DIR/phase2: every layer) instead of running the frozen BERT on
# every batch. Size: BERT tokens x hidden x (1 or L) x 2 bytes, e.g. IWSLT'14 with bert-base ~7 GB for phase 1
# but ~80 GB for phase 2 (WMT'14 with bert-large: ~0.26 TB / ~6 TB, so phase 1 at most); see docs/notes/bert_jam.md.
# Options:  --dry-run   print every command (one per line, shell-quoted) instead of running it
#           --from-phase N   skip the phases before N (their checkpoints must exist)
set -euo pipefail
DRY_RUN=0
FROM_PHASE=1
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY_RUN=1; shift ;;
    --from-phase) FROM_PHASE="$2"; shift 2 ;;
    -h|--help) sed -n '1,/^set -euo/p' "$0" | grep '^#'; exit 0 ;;
    *) echo "$(basename "$0"): unknown option '$1' (see --help)" >&2; exit 2 ;;
  esac
done
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
USER_DIR="$ROOT/fairseq_ext"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

source "$ROOT/recipes/bert_jam/run.sh"

if [ "$DRY_RUN" = 0 ]; then
  [ -f "$BIN/dict.$SRC.txt" ] || { echo "$(basename "$0"): BIN=$BIN has no dict.$SRC.txt; binarise the data first (see the header)" >&2; exit 1; }
  [ -f "$TEXT/train.$SRC" ] || { echo "$(basename "$0"): TEXT=$TEXT has no train.$SRC (the BPE'd text given to fairseq-preprocess)" >&2; exit 1; }
  [ -f "$BERT/config.json" ] || { echo "$(basename "$0"): BERT=$BERT is not a local model directory (config.json, weights, vocab); no download happens here" >&2; exit 1; }
fi

# the paper's optimisation settings (Section 3.2) and the official README's flags
COMMON=(
  "$BIN" --user-dir "$USER_DIR" --task translation_bert --bert-model-name "$BERT"
  --source-lang "$SRC" --target-lang "$TGT" --arch "$ARCH" --share-all-embeddings
  --optimizer adam --adam-betas '(0.9,0.98)' --lr 0.0005 --lr-scheduler inverse_sqrt
  --warmup-updates 4000 --warmup-init-lr 1e-07 --weight-decay 0.0001
  --criterion label_smoothed_cross_entropy --label-smoothing 0.1 --dropout 0.3
  --max-tokens 4000 --update-freq "$UPDATE_FREQ" --bert-dropnet 0.5
  --keep-last-epochs 10 --ddp-backend legacy_ddp --fp16
)

# 0. BERT input, once, beside the binarised data
if [ ! -f "$BIN/bert_input.$SRC.json" ] || [ "$DRY_RUN" = 1 ]; then
  run python -m fairseq_ext.bert_jam.prepare "$BIN" --source-lang "$SRC" --target-lang "$TGT" \
    --bert-model-name "$BERT" --trainpref "$TEXT/train" --validpref "$TEXT/valid" --testpref "$TEXT/test"
fi

# phase N+1 starts from phase N's last checkpoint (optimizer state reset, epoch counter and LR schedule kept);
# when phase N+1 already has checkpoints (an interrupted run) it resumes from them instead
start_from() {
  if [ "$DRY_RUN" = 0 ] && [ -f "$SAVE/$2/checkpoint_last.pt" ]; then echo ""; else
    echo "--restore-file $SAVE/$1/checkpoint_last.pt --reset-optimizer"; fi
}

# 1. warm-up: BERT and GLUs frozen (GLU output x2), train until convergence
# --bert-feature-cache for the frozen-BERT phases (opt-in: BERT_FEATURE_CACHE=DIR)
cache_for() { if [ -n "${BERT_FEATURE_CACHE:-}" ]; then echo "--bert-feature-cache $BERT_FEATURE_CACHE/$1"; fi; }
[ "$FROM_PHASE" -le 1 ] && run fairseq-train "${COMMON[@]}" --bert-jam-phase 1 --save-dir "$SAVE/phase1" \
  --max-epoch "$PHASE1_EPOCHS" $(cache_for phase1)
# 2. GLUs trainable; continues phase 1's epoch counter and LR schedule, optimizer state reset
[ "$FROM_PHASE" -le 2 ] && run fairseq-train "${COMMON[@]}" --bert-jam-phase 2 --save-dir "$SAVE/phase2" \
  $(start_from phase1 phase2) --max-epoch "$PHASE2_EPOCHS" $(cache_for phase2)
# 3. fine-tune BERT (pooler excluded) for a fixed PHASE3_EPOCHS - PHASE2_EPOCHS (10) epochs, all of which step 4
#    averages (no early stopping: it would leave fewer epoch checkpoints than are averaged)
[ "$FROM_PHASE" -le 3 ] && run fairseq-train "${COMMON[@]}" --bert-jam-phase 3 --save-dir "$SAVE/phase3" \
  $(start_from phase2 phase3) --max-epoch "$PHASE3_EPOCHS"

# 4. average the last 10 epoch checkpoints of phase 3, translate the test set, score
run python -m fairseq_ext.average_checkpoints --inputs "$SAVE/phase3" --num-epoch-checkpoints 10 \
  --output "$SAVE/phase3/checkpoint_avg10.pt"
GEN=(fairseq-generate "$BIN" --user-dir "$USER_DIR" --task translation_bert --source-lang "$SRC" --target-lang "$TGT"
  --path "$SAVE/phase3/checkpoint_avg10.pt" --gen-subset test --batch-size 128 --remove-bpe "${GEN_ARGS[@]}")
run_sh "$(printf '%q ' "${GEN[@]}")> $(printf '%q' "$SAVE/generate-test.txt")"
S=$(printf '%q' "$SAVE")
run_sh "grep -P '^H-[0-9]+\t' $S/generate-test.txt | sed 's/^H-//' | sort -n -k1,1 | cut -f3 > $S/test.hyp"
run_sh "grep -P '^T-[0-9]+\t' $S/generate-test.txt | sed 's/^T-//' | sort -n -k1,1 | cut -f2 > $S/test.ref"
if [ "${COMPOUND_SPLIT:-0}" = 1 ]; then  # Vaswani et al. 2017 / the paper's WMT14 scoring
  for f in hyp ref; do
    run_sh "perl -ple 's{(\S)-(\S)}{\$1 ##AT##-##AT## \$2}g' < $S/test.$f > $S/test.$f.cs"
  done
  run_sh "fairseq-score --sys $S/test.hyp.cs --ref $S/test.ref.cs | tee $S/bleu.txt"
else  # tokenised BLEU as multi-bleu.perl (the paper's IWSLT'14 numbers)
  run_sh "fairseq-score --sys $S/test.hyp --ref $S/test.ref | tee $S/bleu.txt"
fi
