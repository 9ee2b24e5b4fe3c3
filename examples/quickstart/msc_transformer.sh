# msc_transformer (Multiscale Collaborative deep NMT, Wei et al. 2020), sized for a few CPU minutes on the
# bundled ~13k sentence pairs: 3 encoder blocks x 2 pre-norm layers (6 encoder layers), 3 decoder layers each
# attending to its encoder block and to the GRU context state C^n (gated fusion), d 256, FFN 512, 4 heads,
# all embeddings shared. The paper's IWSLT models are the msc_transformer_iwslt_de_en{,_36l,_54l,_72l}
# presets (recipes/msc/iwslt.sh).
TRAIN_ARGS=(
  --encoder-blocks 3 --encoder-layers-per-block 2
  --encoder-embed-dim 256 --decoder-embed-dim 256 --encoder-ffn-embed-dim 512 --decoder-ffn-embed-dim 512
  --encoder-attention-heads 4 --decoder-attention-heads 4
  --share-all-embeddings --dropout 0.2 --attention-dropout 0.1
  --optimizer adam --adam-betas '(0.9, 0.98)' --lr 0.002 --lr-scheduler inverse_sqrt --warmup-updates 400
  --clip-norm 0.0 --criterion label_smoothed_cross_entropy --label-smoothing 0.1 --max-tokens 4096
)
GEN_ARGS=(--beam 5 --lenpen 1.0 --max-len-a 1.2 --max-len-b 10)  # bounded output: a briefly trained model may not stop
