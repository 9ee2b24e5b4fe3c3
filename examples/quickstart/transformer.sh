# fairseq's own `transformer`, sized to learn something in a few CPU minutes on ~13k sentence pairs:
# 3+3 layers, d 256, FFN 512, 4 heads, all embeddings shared; small batches and a short warm-up, so that the
# few minutes of training are a few hundred updates. Outputs are bounded (1.2 x source + 10) so that a
# briefly trained model that does not stop yet cannot decode 200 tokens per sentence.
TRAIN_ARGS=(
  --encoder-layers 3 --decoder-layers 3 --encoder-embed-dim 256 --decoder-embed-dim 256
  --encoder-ffn-embed-dim 512 --decoder-ffn-embed-dim 512 --encoder-attention-heads 4 --decoder-attention-heads 4
  --share-all-embeddings --dropout 0.1 --attention-dropout 0.1
  --optimizer adam --adam-betas '(0.9, 0.98)' --lr 0.002 --lr-scheduler inverse_sqrt --warmup-updates 100
  --clip-norm 0.0 --criterion label_smoothed_cross_entropy --label-smoothing 0.1 --max-tokens 2048
)
GEN_ARGS=(--beam 5 --lenpen 1.0 --max-len-a 1.2 --max-len-b 10)
