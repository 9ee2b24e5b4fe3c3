# Semi-Autoregressive Transformer (Wang et al. 2018), K words per decoder step, with the paper's pipeline:
#   1. a quick fairseq `transformer` teacher (same size and updates as the quickstart's transformer),
#   2. sequence-level knowledge distillation: the teacher translates the training set (beam $SAT_KD_BEAM),
#      binarised with the teacher's dictionary,
#   3. the SAT student (--sat-group-size $SAT_K) trained on the distilled data for the same number of updates,
#      initialised from the teacher: every weight, the decoder layers included (--sat-init-from with
#      --sat-init-decoder), at a peak lr of $SAT_LR.
#   then the quickstart's averaging, generation (--task translation_sat) and interactive steps.
# Step 3's recipe is the distilled one of the claims run (docs/CLAIMS.md, SAT: init decoder, beam-4 distillation);
# that run's pilots chose lr 0.008 for 6,000 updates from its stronger teacher; this short run keeps 0.004 (SAT_LR). The release
# students K=2/4/6 are that run's distilled students (docs/sat_transformer.md, "Release and quickstart").
# Total time is about twice the transformer's plus the distillation decode. Environment: SAT_K (default 2),
# SAT_KD_BEAM (default 4; 1 = greedy, faster to translate the 29k Bible verses), SAT_LR (the
# student's peak lr, default 0.004), SAT_BEAM (beam of the final evaluation, default 4; 1 = greedy, the
# fastest), SAT_TEACHER (a fairseq transformer checkpoint trained on the same dictionary, e.g.
# releases/bible-de-en/transformer.pt: the teacher, instead of training one in step 1).
# From a release (the default when releases/ has one for K=$SAT_K): no teacher and no distillation; the student
# continues on the real training targets for RELEASE_UPDATES updates.
# Same size as the quickstart transformer (Bible: 3+3 layers, d 128, FFN 512, 4 heads, all embeddings shared).
source "$ROOT/examples/quickstart/transformer.sh"
SAT_K="${SAT_K:-2}"
SAT_KD_BEAM="${SAT_KD_BEAM:-4}"
SAT_LR="${SAT_LR:-0.004}"
SAT_BEAM="${SAT_BEAM:-4}"
TASK=translation_sat
TEACHER_ARGS=("${TRAIN_ARGS[@]}")
TRAIN_ARGS+=(--sat-group-size "$SAT_K")
GEN_ARGS=(--beam "$SAT_BEAM" --lenpen 1.0 --max-len-a 1.2 --max-len-b 10)

RELEASE_NAME="sat_transformer_k$SAT_K" RELEASE_UPDATES=300 RELEASE_LR=0.0005

arch_prepare_release() {
  CKPT="$CKPT-k$SAT_K"
  OUTDIR="$OUTDIR-k$SAT_K"
  mkdir -p "$CKPT" "$OUTDIR"
}

arch_prepare() {
  local teacher="$WORKDIR/checkpoints/sat-teacher-$SRC-$TGT"
  local teacher_ckpt="$teacher/checkpoint_avg.pt"
  local kd="$WORKDIR/kd-$SRC-$TGT"
  local kdbin="$WORKDIR/bin-$SRC-$TGT-kd"
  if [ -n "${SAT_TEACHER:-}" ]; then  # distillation data of another teacher are kept apart
    teacher_ckpt="$SAT_TEACHER"
    kd="$kd-$(basename "$SAT_TEACHER" .pt)" kdbin="$kdbin-$(basename "$SAT_TEACHER" .pt)"
    step "SAT 1/3: the teacher is SAT_TEACHER=$SAT_TEACHER"
  fi
  mkdir -p "$teacher" "$kd"
  if [ -z "${SAT_TEACHER:-}" ] && [ ! -f "$teacher/.done" ]; then
    step "SAT 1/3: teacher (fairseq transformer, same size): $MAX_UPDATE updates, checkpoints in $teacher"
    train_model "$BIN" "$teacher" "$LOGS/train-sat-teacher-$SRC-$TGT.log" --task translation --arch transformer \
      "${TEACHER_ARGS[@]}"
    average_last "$teacher"
    touch "$teacher/.done"
  fi
  if [ ! -f "$kdbin/.done" ]; then
    step "SAT 2/3: sequence-level distillation: the teacher translates the training set (beam $SAT_KD_BEAM)"
    # --smoke: distil 1/50 of the training set (fairseq-generate shards by the distributed rank, not
    # --num-shards), greedy and at most 16 words
    local KD_ARGS=(--beam "$SAT_KD_BEAM" --max-len-a 1.2 --max-len-b 10)
    if [ "$SMOKE" = 1 ]; then
      KD_ARGS=(--beam 1 --max-len-a 0 --max-len-b 16 --distributed-world-size 50 --distributed-rank 0)
    fi
    quiet "$LOGS/generate-train-sat-teacher-$SRC-$TGT.log" fairseq-generate "$BIN" --user-dir "$ROOT/fairseq_ext" \
      --task translation --source-lang "$SRC" --target-lang "$TGT" --path "$teacher_ckpt" \
      --gen-subset train "${KD_ARGS[@]}" --batch-size 256 --num-workers 0 --results-path "$kd"
    quiet "$LOGS/distill-$SRC-$TGT.log" python -m fairseq_ext.sat.distill --generate-output "$kd/generate-train.txt" \
      --source "$DATA/train.spm.$SRC" --out-prefix "$kd/train" --source-lang "$SRC" --target-lang "$TGT"
    rm -rf "$kdbin"
    quiet "$LOGS/preprocess-kd-$SRC-$TGT.log" fairseq-preprocess --source-lang "$SRC" --target-lang "$TGT" \
      --trainpref "$kd/train" --validpref "$DATA/valid.spm" --testpref "$DATA/test.spm" \
      --srcdict "$BIN/dict.$SRC.txt" --tgtdict "$BIN/dict.$TGT.txt" --destdir "$kdbin" --workers 2
    touch "$kdbin/.done"
    say "$(tail -n 1 "$LOGS/distill-$SRC-$TGT.log")  [$(took)]"
  fi
  step "SAT 3/3: the student (K=$SAT_K) trains on $kdbin, initialised from $teacher_ckpt"
  BIN="$kdbin"
  CKPT="$CKPT-k$SAT_K"
  OUTDIR="$OUTDIR-k$SAT_K"
  mkdir -p "$CKPT" "$OUTDIR"
  TRAIN_ARGS+=(--sat-init-from "$teacher_ckpt" --sat-init-decoder --lr "$SAT_LR")
}
