# Shared SAT pipeline (sourced by wmt14_en_de.sh and iwslt14_de_en.sh; not run directly).
# Inputs (set by the caller): SRC TGT BIN TEXT WORKDIR TEACHER_ARCH SAT_ARCH KS TEACHER_ARGS SAT_ARGS
#   GEN_BEAM_ARGS DRY_RUN NUM_AVG KD_BEAM BPE_FLAG KD_ARGS (distillation decode) TEST_ARGS (test decodes)
# Steps (the paper's Sec. 4.1 and the authors' sa-nmt README):
#   1. train the autoregressive teacher, average its last NUM_AVG checkpoints;
#   2. sequence-level KD: the teacher translates the training set (beam KD_BEAM); binarise the result
#      with the teacher's dictionaries;
#   3. for each K in KS: train the SAT on the distilled data, initialised from the teacher
#      (--sat-init-from: encoder, embeddings, softmax), average;
#   4. evaluate every model on the test set with beam 4 and greedy (BLEU), and latency at batch size 1;
#      the summary table (model, beam, BLEU, sentences/s) goes to $WORKDIR/results/summary.tsv.

source "$(dirname "${BASH_SOURCE[0]}")/run.sh"
need() {
  if [ "$DRY_RUN" != 1 ] && [ ! -e "$1" ]; then
    echo "$(basename "$0"): $1 not found: $2" >&2; exit 2
  fi
}

USER_DIR="$ROOT/fairseq_ext"
TEACHER_DIR="$WORKDIR/checkpoints/teacher"
KD_TEXT="$WORKDIR/kd"
KD_BIN="$WORKDIR/data-bin-kd"
RESULTS="$WORKDIR/results"
[ "$DRY_RUN" = 1 ] || mkdir -p "$TEACHER_DIR" "$KD_TEXT" "$RESULTS"
need "$BIN/dict.$SRC.txt" "binarised data (fairseq-preprocess --joined-dictionary) expected in --data-bin"
need "$TEXT/train.$SRC" "the BPE'd training text (input of fairseq-preprocess) expected in --text"

echo "== 1/4 teacher ($TEACHER_ARCH) =="
run fairseq-train "$BIN" --user-dir "$USER_DIR" --task translation --arch "$TEACHER_ARCH" \
  --source-lang "$SRC" --target-lang "$TGT" --save-dir "$TEACHER_DIR" "${TEACHER_ARGS[@]}"
run python -m fairseq_ext.average_checkpoints --inputs "$TEACHER_DIR" --num-update-checkpoints "$NUM_AVG" \
  --output "$TEACHER_DIR/checkpoint_avg.pt"

echo "== 2/4 sequence-level knowledge distillation (teacher beam $KD_BEAM on the training set) =="
run_to "$KD_TEXT/generate-train.txt" fairseq-generate "$BIN" --user-dir "$USER_DIR" --task translation \
  --source-lang "$SRC" --target-lang "$TGT" --path "$TEACHER_DIR/checkpoint_avg.pt" --gen-subset train \
  --beam "$KD_BEAM" --lenpen 0.6 --max-len-a 1.2 --max-len-b 10 --max-tokens 16000 ${KD_ARGS[@]+"${KD_ARGS[@]}"}
run python -m fairseq_ext.sat.distill --generate-output "$KD_TEXT/generate-train.txt" \
  --source "$TEXT/train.$SRC" --out-prefix "$KD_TEXT/train" --source-lang "$SRC" --target-lang "$TGT"
run fairseq-preprocess --source-lang "$SRC" --target-lang "$TGT" --trainpref "$KD_TEXT/train" \
  --validpref "$TEXT/valid" --testpref "$TEXT/test" --srcdict "$BIN/dict.$SRC.txt" --tgtdict "$BIN/dict.$TGT.txt" \
  --destdir "$KD_BIN" --workers 8

echo "== 3/4 SAT students K in {${KS[*]}} (distilled data, initialised from the teacher) =="
for K in "${KS[@]}"; do
  run fairseq-train "$KD_BIN" --user-dir "$USER_DIR" --task translation_sat --arch "$SAT_ARCH" --sat-group-size "$K" \
    --sat-init-from "$TEACHER_DIR/checkpoint_avg.pt" --source-lang "$SRC" --target-lang "$TGT" \
    --save-dir "$WORKDIR/checkpoints/sat-k$K" "${SAT_ARGS[@]}"
  run python -m fairseq_ext.average_checkpoints --inputs "$WORKDIR/checkpoints/sat-k$K" \
    --num-update-checkpoints "$NUM_AVG" --output "$WORKDIR/checkpoints/sat-k$K/checkpoint_avg.pt"
done

echo "== 4/4 evaluation: BLEU with beam 4 and greedy, latency at batch size 1 =="
MODELS=("teacher:$TEACHER_DIR/checkpoint_avg.pt")
for K in "${KS[@]}"; do MODELS+=("sat-k$K:$WORKDIR/checkpoints/sat-k$K/checkpoint_avg.pt"); done
for entry in "${MODELS[@]}"; do
  name="${entry%%:*}"; ckpt="${entry#*:}"
  for beam in 4 1; do
    run_to "$RESULTS/$name.beam$beam.txt" fairseq-generate "$KD_BIN" --user-dir "$USER_DIR" --task translation_sat \
      --source-lang "$SRC" --target-lang "$TGT" --path "$ckpt" --gen-subset test --beam "$beam" "${GEN_BEAM_ARGS[@]}" \
      --max-tokens 8000 ${TEST_ARGS[@]+"${TEST_ARGS[@]}"} $BPE_FLAG
    run_to "$RESULTS/$name.beam$beam.latency.txt" fairseq-generate "$KD_BIN" --user-dir "$USER_DIR" \
      --task translation_sat --source-lang "$SRC" --target-lang "$TGT" --path "$ckpt" --gen-subset test \
      --beam "$beam" "${GEN_BEAM_ARGS[@]}" --batch-size 1 --quiet ${TEST_ARGS[@]+"${TEST_ARGS[@]}"} $BPE_FLAG
  done
done
echo "== summary: BLEU (fairseq-generate's BLEU4 line) and sentences/s at batch 1 -> $RESULTS/summary.tsv =="
for entry in "${MODELS[@]}"; do
  for beam in 4 1; do
    printf 'score: grep -oP %q %q | tail -1\n' 'BLEU4? = \K[0-9.]+' "$RESULTS/${entry%%:*}.beam$beam.txt"
    printf 'score: grep -oP %q %q | tail -1\n' '[0-9.]+(?= sentences/s)' "$RESULTS/${entry%%:*}.beam$beam.latency.txt"
  done
done
if [ "$DRY_RUN" != 1 ]; then
  echo "model	beam	BLEU	sentences/s at batch 1"
  for entry in "${MODELS[@]}"; do
    name="${entry%%:*}"
    for beam in 4 1; do
      bleu=$(grep -oP 'BLEU4? = \K[0-9.]+' "$RESULTS/$name.beam$beam.txt" | tail -1)
      speed=$(grep -oP '[0-9.]+(?= sentences/s)' "$RESULTS/$name.beam$beam.latency.txt" | tail -1)
      echo "$name	$beam	$bleu	$speed"
    done
  done | tee "$RESULTS/summary.tsv"
fi
