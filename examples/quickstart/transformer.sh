# fairseq's own `transformer`, sized to learn in a few CPU minutes.
# Bible corpus (default): 3+3 layers, d 128, FFN 512, 4 heads, all embeddings shared (2.5M parameters), adam
# inverse_sqrt; a fixed number of updates (about 6 minutes on 2 idle cores), the last checkpoints averaged.
# Ding corpus: the earlier quickstart model, 3+3 layers, d 256, FFN 512.
if [ "$CORPUS" = bible ]; then
  DIM=128 WARMUP=200 MAX_TOKENS=1024 MAX_UPDATE=1500 SAVE_EVERY=100 AVERAGE_LAST=5
else
  DIM=256 WARMUP=100 MAX_TOKENS=2048 MAX_UPDATE=300 SAVE_EVERY=50 AVERAGE_LAST=3
fi
TRAIN_ARGS=(
  --encoder-layers 3 --decoder-layers 3 --encoder-embed-dim "$DIM" --decoder-embed-dim "$DIM"
  --encoder-ffn-embed-dim 512 --decoder-ffn-embed-dim 512 --encoder-attention-heads 4 --decoder-attention-heads 4
  --share-all-embeddings --dropout 0.1 --attention-dropout 0.1
  --optimizer adam --adam-betas '(0.9, 0.98)' --lr 0.002 --lr-scheduler inverse_sqrt --warmup-updates "$WARMUP"
  --clip-norm 0.0 --criterion label_smoothed_cross_entropy --label-smoothing 0.1 --max-tokens "$MAX_TOKENS"
)
GEN_ARGS=(--beam 5 --lenpen 1.0 --max-len-a 1.2 --max-len-b 10)  # bounded: a briefly trained model may not stop
