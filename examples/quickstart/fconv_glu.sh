# ConvS2S (fconv_glu, Gehring et al. 2017) on the bundled corpus, with the sizes of the paper's / fairseq's
# IWSLT'14 De-En model (= --arch fconv_glu_iwslt_de_en): 4 encoder + 3 decoder GLU convolution layers of width
# 256, kernel 3, multi-step attention in every decoder layer; the decoder input/output embeddings are tied for
# the small joint 8k BPE vocabulary (7.9M parameters).
# Training follows the paper's IWSLT recipe: NAG, lr 0.25, gradient norm clipped at 0.1, dropout 0.2,
# max-tokens 4000; label smoothing 0.1 helps on 12.8k sentence pairs.
TRAIN_ARGS=(
  --encoder-embed-dim 256 --encoder-layers "[(256, 3)] * 4"
  --decoder-embed-dim 256 --decoder-layers "[(256, 3)] * 3" --decoder-out-embed-dim 256
  --share-input-output-embed --dropout 0.2
  --optimizer nag --lr 0.25 --clip-norm 0.1 --lr-scheduler fixed
  --criterion label_smoothed_cross_entropy --label-smoothing 0.1 --max-tokens 4000
)
GEN_ARGS=(--beam 5 --lenpen 1.0 --max-len-a 1.2 --max-len-b 10)  # outputs at most 1.2 x source + 10 tokens
AVERAGE_LAST=3
