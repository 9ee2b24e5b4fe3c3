# msc_transformer (Multiscale Collaborative deep NMT, Wei et al. 2020), sized for a few CPU minutes: 3 encoder
# blocks x 2 pre-norm layers (6 encoder layers), 3 decoder layers each attending to its encoder block and to the
# GRU context state C^n (gated fusion), FFN 512, 4 heads, all embeddings shared; d 128 on the Bible corpus (as
# benchmarks/compare/specs.py; peak lr 0.003 and no dropout, as the quickstart transformer), d 256 on Ding. The
# paper's IWSLT models are the msc_transformer_iwslt_de_en{,_36l,_54l,_72l} presets (recipes/msc/iwslt.sh).
if [ "$CORPUS" = bible ]; then D=128 LR=0.003 DROPOUT=0.0 BATCH=(--max-tokens 1024 --warmup-updates 200) MAX_UPDATE=1200 SAVE_EVERY=100 AVERAGE_LAST=3
else D=256 LR=0.002 DROPOUT=0.1 BATCH=(--max-tokens 4096 --warmup-updates 400) MAX_UPDATE=150 SAVE_EVERY=25 AVERAGE_LAST=3
fi
TRAIN_ARGS=(
  --encoder-blocks 3 --encoder-layers-per-block 2
  --encoder-embed-dim "$D" --decoder-embed-dim "$D" --encoder-ffn-embed-dim 512 --decoder-ffn-embed-dim 512
  --encoder-attention-heads 4 --decoder-attention-heads 4
  --share-all-embeddings --dropout "$DROPOUT" --attention-dropout "$DROPOUT"
  --optimizer adam --adam-betas '(0.9, 0.98)' --lr "$LR" --lr-scheduler inverse_sqrt "${BATCH[@]}"
  --clip-norm 0.0 --criterion label_smoothed_cross_entropy --label-smoothing 0.1
)
GEN_ARGS=(--beam 5 --lenpen 1.0 --max-len-a 1.2 --max-len-b 10)  # bounded output: a briefly trained model may not stop
# from the release (releases/bible-de-en/msc_transformer.pt, 3,000 updates): 400 more, from about the lr it ended at
RELEASE_UPDATES=400 RELEASE_LR=0.0008
