#!/usr/bin/env bash
# MSC (Wei et al., ACL 2020) on WMT14 En->De with the paper's settings (Sec. 4.1, Table 4).
#
#   bash recipes/msc/wmt14_en_de.sh --data-dir RAW [--size base|big] [--depth 6|36|48 (base) | 6|18 (big)]
#        [--plain] [--workdir DIR] [--gpus G] [--dry-run]
#
#   --data-dir  Moses-tokenized text (as fairseq's prepare-wmt14en2de.sh without its BPE step; ~4.5M pairs):
#               train.en train.de valid.en valid.de test.en test.de (newstest2014). The paper validates on
#               newstest2013; fairseq's prepare-wmt14en2de.sh gives every 100th training pair as valid instead
#               (either works for checkpoint selection; put newstest2013 there to follow the paper)
#   --size      base (512/2048, Adam 0.9/0.98, 8k warm-up, 100k updates, average the last 5 epoch checkpoints)
#               or big (1024/4096, Adam 0.9/0.998, 16k warm-up, 300k updates, average the last 20)
#   --depth     encoder depth: base 6 (6x1), 36 (6x6), 48 (6x8); big 6 (6x1), 18 (6x3)
#   --plain     the plain pre-norm baseline (no block-scale / contextual collaboration)
#   --gpus      GPUs of the job (default 8, as the paper; fairseq-train --distributed-world-size): the batch
#               is 65k tokens per update, 4096 tokens per GPU and --update-freq 16/G (8 GPUs: 2 accumulations;
#               the paper's 8 x 8 x 1024 is the same batch in 4x more micro-batches)
#   --dry-run   print every command, run nothing
#
# Joint BPE: sentencepiece BPE with a 32k vocabulary here (the paper: 32k merge operations of subword-nmt,
# about 37k tokens), shared embeddings, label smoothing 0.1, inverse-sqrt schedule with
# the peak of Vaswani et al.'s schedule (d^-0.5 * warmup^-0.5); beam 4, length penalty 0.6; tokenized
# case-sensitive BLEU with compound splitting (the usual ##AT##-##AT## convention), as multi-bleu.perl.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
DATA_DIR=""; SIZE=base; DEPTH=""; PLAIN=0; WORKDIR=""; GPUS=8; DRY=0
while [ $# -gt 0 ]; do
  case "$1" in
    --data-dir) DATA_DIR="$2"; shift 2 ;;
    --size) SIZE="$2"; shift 2 ;;
    --depth) DEPTH="$2"; shift 2 ;;
    --plain) PLAIN=1; shift ;;
    --workdir) WORKDIR="$2"; shift 2 ;;
    --gpus) GPUS="$2"; shift 2 ;;
    --dry-run) DRY=1; shift ;;
    -h|--help) sed -n '2,22p' "$0"; exit 0 ;;
    *) echo "wmt14_en_de.sh: unknown option '$1' (see --help)" >&2; exit 2 ;;
  esac
done
SRC=en; TGT=de
case "$SIZE:${DEPTH:=$([ "$SIZE" = big ] && echo 18 || echo 48)}" in
  base:6) ARCH=msc_transformer_wmt_en_de ;;
  base:36|base:48) ARCH=msc_transformer_wmt_en_de_${DEPTH}l ;;
  big:6) ARCH=msc_transformer_wmt_en_de_big ;;
  big:18) ARCH=msc_transformer_wmt_en_de_big_18l ;;
  *) echo "wmt14_en_de.sh: --size $SIZE --depth $DEPTH is not in Table 4 (base: 6, 36, 48; big: 6, 18)" >&2; exit 2 ;;
esac
if [ "$SIZE" = base ]; then BETAS='(0.9, 0.98)'; WARMUP=8000; LR=0.000494; MAX_UPDATE=100000; AVG=5   # 512^-0.5 * 8000^-0.5
else BETAS='(0.9, 0.998)'; WARMUP=16000; LR=0.000247; MAX_UPDATE=300000; AVG=20; fi                   # 1024^-0.5 * 16000^-0.5
if [ -z "$DATA_DIR" ]; then echo "wmt14_en_de.sh: give --data-dir with train/valid/test.{en,de} (tokenized text)" >&2; exit 2; fi
if [ "$DRY" -eq 0 ]; then
  for f in train valid test; do for l in "$SRC" "$TGT"; do
    [ -f "$DATA_DIR/$f.$l" ] || { echo "wmt14_en_de.sh: missing $DATA_DIR/$f.$l (see --help)" >&2; exit 2; }
  done; done
fi
MAX_TOKENS=4096; UPDATE_FREQ=$(( 16 / GPUS > 0 ? 16 / GPUS : 1 ))  # 65536 tokens per update
SUFFIX=""; MODEL_ARGS=()
if [ "$PLAIN" -eq 1 ]; then SUFFIX=-plain; MODEL_ARGS+=(--no-contextual-collaboration --no-block-scale-collaboration); fi
NAME="msc-$SIZE-$DEPTH$SUFFIX"
WORKDIR="${WORKDIR:-$ROOT/work/msc-wmt14}"
BIN="$WORKDIR/bin"; SPM="$WORKDIR/spm32k"; CKPT="$WORKDIR/checkpoints/$NAME"; OUT="$WORKDIR/out/$NAME"

run() { printf '+'; printf ' %q' "$@"; printf '\n'; if [ "$DRY" -eq 0 ]; then "$@"; fi; }
run_sh() { printf '+ %s\n' "$1"; if [ "$DRY" -eq 0 ]; then bash -c "$1"; fi; }

run mkdir -p "$WORKDIR" "$CKPT" "$OUT"
# 1. joint 32k BPE
run_sh "cat '$DATA_DIR/train.$SRC' '$DATA_DIR/train.$TGT' > '$WORKDIR/train.joint'"
run python -c "import sentencepiece as s; s.SentencePieceTrainer.train(input='$WORKDIR/train.joint', model_prefix='$SPM', vocab_size=32000, model_type='bpe', character_coverage=1.0, input_sentence_size=5000000, shuffle_input_sentence=True)"
for split in train valid test; do for l in "$SRC" "$TGT"; do
  run_sh "python -c \"import sys, sentencepiece as s; sp = s.SentencePieceProcessor(model_file='$SPM.model'); sys.stdout.writelines(' '.join(sp.encode(l.rstrip('\\\\n'), out_type=str)) + '\\\\n' for l in sys.stdin)\" < '$DATA_DIR/$split.$l' > '$WORKDIR/$split.bpe.$l'"
done; done
# 2. binarise with a joined dictionary
run fairseq-preprocess --source-lang "$SRC" --target-lang "$TGT" --trainpref "$WORKDIR/train.bpe" \
  --validpref "$WORKDIR/valid.bpe" --testpref "$WORKDIR/test.bpe" --destdir "$BIN" --joined-dictionary --workers 16
# 3. train (--ddp-backend legacy_ddp is not needed: every parameter gets a gradient)
run fairseq-train "$BIN" --user-dir "$ROOT/fairseq_ext" --task translation --source-lang "$SRC" --target-lang "$TGT" \
  --arch "$ARCH" "${MODEL_ARGS[@]}" --share-all-embeddings \
  --optimizer adam --adam-betas "$BETAS" --clip-norm 0.0 --lr "$LR" --lr-scheduler inverse_sqrt \
  --warmup-updates "$WARMUP" --warmup-init-lr 1e-07 --criterion label_smoothed_cross_entropy --label-smoothing 0.1 \
  --max-tokens "$MAX_TOKENS" --update-freq "$UPDATE_FREQ" --distributed-world-size "$GPUS" --max-update "$MAX_UPDATE" --fp16 \
  --save-dir "$CKPT" --keep-last-epochs "$AVG" --log-format json --log-interval 100 --seed 1
# 4. average the last 5 (base) / 20 (big) epoch checkpoints
run python -m fairseq_ext.average_checkpoints --inputs "$CKPT" --num-epoch-checkpoints "$AVG" --output "$CKPT/checkpoint_avg.pt"
# 5. beam 4, lenpen 0.6; tokenized case-sensitive BLEU with compound splitting
run_sh "fairseq-generate '$BIN' --user-dir '$ROOT/fairseq_ext' --task translation --source-lang $SRC --target-lang $TGT --path '$CKPT/checkpoint_avg.pt' --gen-subset test --beam 4 --lenpen 0.6 --batch-size 128 --remove-bpe sentencepiece > '$OUT/generate-test.txt'"
run_sh "grep -P '^D-[0-9]+\t' '$OUT/generate-test.txt' | sed 's/^D-//' | sort -n -k1,1 | cut -f3 | perl -ple 's{(\S)-(\S)}{\$1 ##AT##-##AT## \$2}g' > '$OUT/test.hyp.split'"
run_sh "perl -ple 's{(\S)-(\S)}{\$1 ##AT##-##AT## \$2}g' < '$DATA_DIR/test.$TGT' > '$OUT/test.ref.split'"
run_sh "sacrebleu '$OUT/test.ref.split' -i '$OUT/test.hyp.split' --tokenize none -m bleu -w 2 | tee '$OUT/bleu.json'"
