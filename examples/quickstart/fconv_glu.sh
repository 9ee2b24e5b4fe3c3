# ConvS2S (fconv_glu, Gehring et al. 2017): GLU convolutions with kernel 3 and multi-step attention in every
# decoder layer, 4 encoder + 3 decoder layers, the decoder input/output embeddings tied. The paper's IWSLT'14
# De-En sizes (= --arch fconv_glu_iwslt_de_en) are width 256; the Bible corpus uses width 128 (as
# benchmarks/compare/specs.py) so that a few CPU minutes are enough updates, Ding keeps 256 (7.9M parameters).
# Training follows the paper's IWSLT recipe: NAG, lr 0.25, gradient norm clipped at 0.1, dropout 0.2 (0 on the
# Bible corpus, whose run sees about one epoch, as for the transformer); label smoothing 0.1.
if [ "$CORPUS" = bible ]; then W=128 BATCH=2048 MAX_UPDATE=1000 SAVE_EVERY=100 AVERAGE_LAST=3 DROPOUT=0.0
else W=256 BATCH=4000 MAX_UPDATE=250 SAVE_EVERY=25 AVERAGE_LAST=3 DROPOUT=0.2
fi
TRAIN_ARGS=(
  --encoder-embed-dim "$W" --encoder-layers "[($W, 3)] * 4"
  --decoder-embed-dim "$W" --decoder-layers "[($W, 3)] * 3" --decoder-out-embed-dim "$W"
  --share-input-output-embed --dropout "$DROPOUT"
  --optimizer nag --lr 0.25 --clip-norm 0.1 --lr-scheduler fixed
  --criterion label_smoothed_cross_entropy --label-smoothing 0.1 --max-tokens "$BATCH"
)
GEN_ARGS=(--beam 5 --lenpen 1.0 --max-len-a 1.2 --max-len-b 10)  # outputs at most 1.2 x source + 10 tokens
# from the release (releases/bible-de-en/fconv_glu.pt, 3,000 updates): 600 more, the training lr annealed to 0
RELEASE_UPDATES=600 RELEASE_LR=0.25
