# Semi-Autoregressive Transformer (Wang et al. 2018), K words per decoder step, with the paper's pipeline:
#   1. a quick fairseq `transformer` teacher (same size, --minutes of training),
#   2. sequence-level knowledge distillation: the teacher translates the training set (beam $SAT_KD_BEAM),
#      binarised with the teacher's dictionary,
#   3. the SAT student (--sat-group-size $SAT_K) trained on the distilled data for --minutes, initialised
#      from the teacher (encoder, embeddings, softmax: --sat-init-from),
#   then the quickstart's averaging, generation (--task translation_sat) and interactive steps.
# Total time is about twice --minutes plus the distillation decode. Environment: SAT_K (default 2),
# SAT_KD_BEAM (default 4), SAT_BEAM (beam of the final evaluation, default 4; 1 = greedy, the fastest).
# Same size as the quickstart transformer: 3+3 layers, d 256, FFN 1024, 4 heads, all embeddings shared.
SAT_K="${SAT_K:-2}"
SAT_KD_BEAM="${SAT_KD_BEAM:-4}"
SAT_BEAM="${SAT_BEAM:-4}"
TASK=translation_sat
SAT_MODEL_ARGS=(
  --encoder-layers 3 --decoder-layers 3 --encoder-embed-dim 256 --decoder-embed-dim 256
  --encoder-ffn-embed-dim 1024 --decoder-ffn-embed-dim 1024 --encoder-attention-heads 4 --decoder-attention-heads 4
  --share-all-embeddings --dropout 0.2 --attention-dropout 0.1
)
SAT_OPT_ARGS=(
  --optimizer adam --adam-betas '(0.9, 0.98)' --lr 0.002 --lr-scheduler inverse_sqrt --warmup-updates 400
  --clip-norm 0.0 --criterion label_smoothed_cross_entropy --label-smoothing 0.1 --max-tokens 4096
)
TRAIN_ARGS=("${SAT_MODEL_ARGS[@]}" "${SAT_OPT_ARGS[@]}" --sat-group-size "$SAT_K")
GEN_ARGS=(--beam "$SAT_BEAM" --lenpen 1.0)

arch_prepare() {
  local teacher="$WORKDIR/checkpoints/sat-teacher-$SRC-$TGT"
  local kd="$WORKDIR/kd-$SRC-$TGT"
  local kdbin="$WORKDIR/bin-$SRC-$TGT-kd"
  mkdir -p "$teacher" "$kd"
  if [ ! -f "$teacher/.done" ]; then
    step "SAT 1/3: teacher (fairseq transformer, same size) for $MINUTES minutes in $teacher"
    train_model "$BIN" "$teacher" --task translation --arch transformer "${SAT_MODEL_ARGS[@]}" "${SAT_OPT_ARGS[@]}"
    average_last "$teacher"
    touch "$teacher/.done"
  fi
  if [ ! -f "$kdbin/.done" ]; then
    step "SAT 2/3: sequence-level distillation: the teacher translates the training set (beam $SAT_KD_BEAM)"
    # --smoke: distil 1/50 of the training set (~250 sentences; fairseq-generate shards by the distributed
    # rank, not --num-shards), greedy and at most 16 words
    local KD_ARGS=(--beam "$SAT_KD_BEAM" --max-len-a 1.2 --max-len-b 10)
    if [ "$SMOKE" = 1 ]; then
      KD_ARGS=(--beam 1 --max-len-a 0 --max-len-b 16 --distributed-world-size 50 --distributed-rank 0)
    fi
    fairseq-generate "$BIN" --user-dir "$ROOT/fairseq_ext" --task translation --source-lang "$SRC" \
      --target-lang "$TGT" --path "$teacher/checkpoint_avg.pt" --gen-subset train "${KD_ARGS[@]}" \
      --batch-size 256 --num-workers 0 > "$kd/generate-train.txt"
    python -m fairseq_ext.sat.distill --generate-output "$kd/generate-train.txt" \
      --source "$DATA/train.spm.$SRC" --out-prefix "$kd/train" --source-lang "$SRC" --target-lang "$TGT"
    rm -rf "$kdbin"
    fairseq-preprocess --source-lang "$SRC" --target-lang "$TGT" --trainpref "$kd/train" \
      --validpref "$DATA/valid.spm" --testpref "$DATA/test.spm" --srcdict "$BIN/dict.$SRC.txt" \
      --tgtdict "$BIN/dict.$TGT.txt" --destdir "$kdbin" --workers 2 > "$kd/preprocess.log"
    touch "$kdbin/.done"
  fi
  step "SAT 3/3: the student (K=$SAT_K) trains on $kdbin, initialised from $teacher/checkpoint_avg.pt"
  BIN="$kdbin"
  CKPT="$CKPT-k$SAT_K"
  OUTDIR="$OUTDIR-k$SAT_K"
  mkdir -p "$CKPT" "$OUTDIR"
  TRAIN_ARGS+=(--sat-init-from "$teacher/checkpoint_avg.pt")
}
