# fairseq's own `transformer`, sized to learn something in a few CPU minutes on ~13k sentence pairs:
# 3+3 layers, d 256, FFN 1024, 4 heads, all embeddings shared (5.8M parameters with the 8k joint BPE).
TRAIN_ARGS=(
  --encoder-layers 3 --decoder-layers 3 --encoder-embed-dim 256 --decoder-embed-dim 256
  --encoder-ffn-embed-dim 1024 --decoder-ffn-embed-dim 1024 --encoder-attention-heads 4 --decoder-attention-heads 4
  --share-all-embeddings --dropout 0.2 --attention-dropout 0.1
  --optimizer adam --adam-betas '(0.9, 0.98)' --lr 0.002 --lr-scheduler inverse_sqrt --warmup-updates 400
  --clip-norm 0.0 --criterion label_smoothed_cross_entropy --label-smoothing 0.1 --max-tokens 4096
)
GEN_ARGS=(--beam 5 --lenpen 1.0)
