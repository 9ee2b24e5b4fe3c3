#!/usr/bin/env bash
# MSC (Wei et al., ACL 2020) on IWSLT: the paper's settings (Sec. 4.1, Tables 1-2), as one script.
#
#   bash recipes/msc/iwslt.sh --direction de-en|en-de|en-fr --data-dir RAW [--depth 6|36|54|72] [--plain]
#        [--workdir DIR] [--gpus G] [--dry-run]
#
#   --data-dir  Moses-tokenized (and lowercased, as in Ranzato et al. 2016 / fairseq's prepare-iwslt14.sh)
#               plain text: train.SRC train.TGT valid.SRC valid.TGT test.SRC test.TGT
#               (IWSLT14 De-En: 160k train / 7584 valid, test = dev2010+dev2012+tst2010-2012;
#                IWSLT17 En-Fr: 236k train / 10263 valid, test = dev2010+tst2010-2015).
#   --depth     encoder depth: 6 (6 blocks x 1), 36 (6x6), 54 (6x9), 72 (6x12; with the L2 criterion, lambda 1e-5)
#   --plain     the plain pre-norm baseline of the same depth (no block-scale / contextual collaboration)
#   --gpus      GPUs for one job (default 1; fairseq-train --distributed-world-size): the batch stays 16k tokens
#               per update
#   --dry-run   print every command, run nothing
#
# Paper settings: joint 10k BPE, all embeddings shared, Adam 0.9/0.98, inverse-sqrt schedule with 4k warm-up
# (6 layers) or 8k (deep) and the peak of Vaswani et al.'s schedule d^-0.5 * warmup^-0.5, label smoothing 0.1,
# 16k tokens per update, 15k updates; beam 5, length penalty 1.0; tokenized case-insensitive BLEU
# (multi-bleu.perl -lc, computed with sacrebleu --tokenize none -lc on the tokenized text).
# Our choices where the paper says nothing for IWSLT: sentencepiece BPE (vocabulary 10k) instead of
# subword-nmt; the average of the last 5 epoch checkpoints (the paper averages only for WMT).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
DIRECTION=de-en; DATA_DIR=""; DEPTH=72; PLAIN=0; WORKDIR=""; GPUS=1; DRY=0
while [ $# -gt 0 ]; do
  case "$1" in
    --direction) DIRECTION="$2"; shift 2 ;;
    --data-dir) DATA_DIR="$2"; shift 2 ;;
    --depth) DEPTH="$2"; shift 2 ;;
    --plain) PLAIN=1; shift ;;
    --workdir) WORKDIR="$2"; shift 2 ;;
    --gpus) GPUS="$2"; shift 2 ;;
    --dry-run) DRY=1; shift ;;
    -h|--help) sed -n '2,24p' "$0"; exit 0 ;;
    *) echo "iwslt.sh: unknown option '$1' (see --help)" >&2; exit 2 ;;
  esac
done
case "$DIRECTION" in de-en|en-de|en-fr) ;; *) echo "iwslt.sh: --direction must be de-en, en-de or en-fr, not '$DIRECTION'" >&2; exit 2 ;; esac
SRC="${DIRECTION%-*}"; TGT="${DIRECTION#*-}"
case "$DEPTH" in
  6) ARCH=msc_transformer_iwslt_de_en; WARMUP=4000; LR=0.000988 ;;   # 256^-0.5 * 4000^-0.5
  36|54|72) ARCH=msc_transformer_iwslt_de_en_${DEPTH}l; WARMUP=8000; LR=0.000699 ;;  # 256^-0.5 * 8000^-0.5
  *) echo "iwslt.sh: --depth must be 6, 36, 54 or 72 (Table 1), not '$DEPTH'" >&2; exit 2 ;;
esac
if [ -z "$DATA_DIR" ]; then echo "iwslt.sh: give --data-dir with train/valid/test.{$SRC,$TGT} (tokenized text)" >&2; exit 2; fi
if [ "$DRY" -eq 0 ]; then
  for f in train valid test; do for l in "$SRC" "$TGT"; do
    [ -f "$DATA_DIR/$f.$l" ] || { echo "iwslt.sh: missing $DATA_DIR/$f.$l (see --help for the expected layout)" >&2; exit 2; }
  done; done
fi
SUFFIX=""; if [ "$PLAIN" -eq 1 ]; then SUFFIX=-plain; fi
NAME="msc${DEPTH}${SUFFIX}-$SRC-$TGT"
WORKDIR="${WORKDIR:-$ROOT/work/msc-iwslt}"
BIN="$WORKDIR/bin-$SRC-$TGT"; SPM="$WORKDIR/spm-$SRC-$TGT"; CKPT="$WORKDIR/checkpoints/$NAME"; OUT="$WORKDIR/out/$NAME"
UPDATE_FREQ=$(( 4 / GPUS > 0 ? 4 / GPUS : 1 ))  # 4096 tokens x 4 = 16k tokens per update on one GPU
MODEL_ARGS=()
CRITERION=(--criterion label_smoothed_cross_entropy --label-smoothing 0.1)
if [ "$PLAIN" -eq 1 ]; then MODEL_ARGS+=(--no-contextual-collaboration --no-block-scale-collaboration); fi
if [ "$DEPTH" = 72 ]; then CRITERION=(--criterion label_smoothed_cross_entropy_l2 --label-smoothing 0.1 --l2-lambda 1e-5); fi

run() { printf '+'; printf ' %q' "$@"; printf '\n'; if [ "$DRY" -eq 0 ]; then "$@"; fi; }
run_sh() { printf '+ %s\n' "$1"; if [ "$DRY" -eq 0 ]; then bash -c "$1"; fi; }

run mkdir -p "$WORKDIR" "$CKPT" "$OUT"
# 1. joint 10k BPE
run_sh "cat '$DATA_DIR/train.$SRC' '$DATA_DIR/train.$TGT' > '$WORKDIR/train.joint.$SRC-$TGT'"
run python -c "import sentencepiece as s; s.SentencePieceTrainer.train(input='$WORKDIR/train.joint.$SRC-$TGT', model_prefix='$SPM', vocab_size=10000, model_type='bpe', character_coverage=1.0, input_sentence_size=2000000, shuffle_input_sentence=True)"
for split in train valid test; do for l in "$SRC" "$TGT"; do
  run_sh "python -c \"import sys, sentencepiece as s; sp = s.SentencePieceProcessor(model_file='$SPM.model'); sys.stdout.writelines(' '.join(sp.encode(l.rstrip('\\n'), out_type=str)) + '\\n' for l in sys.stdin)\" < '$DATA_DIR/$split.$l' > '$WORKDIR/$split.bpe.$SRC-$TGT.$l'"
done; done
# 2. binarise with a joined dictionary
run fairseq-preprocess --source-lang "$SRC" --target-lang "$TGT" --trainpref "$WORKDIR/train.bpe.$SRC-$TGT" \
  --validpref "$WORKDIR/valid.bpe.$SRC-$TGT" --testpref "$WORKDIR/test.bpe.$SRC-$TGT" --destdir "$BIN" \
  --joined-dictionary --workers 8
# 3. train
run fairseq-train "$BIN" --user-dir "$ROOT/fairseq_ext" --task translation --source-lang "$SRC" --target-lang "$TGT" \
  --arch "$ARCH" "${MODEL_ARGS[@]}" --share-all-embeddings \
  --optimizer adam --adam-betas '(0.9, 0.98)' --clip-norm 0.0 --lr "$LR" --lr-scheduler inverse_sqrt \
  --warmup-updates "$WARMUP" --warmup-init-lr 1e-07 "${CRITERION[@]}" \
  --max-tokens 4096 --update-freq "$UPDATE_FREQ" --distributed-world-size "$GPUS" --max-update 15000 \
  --save-dir "$CKPT" --keep-last-epochs 5 --log-format json --log-interval 100 --seed 1
# 4. average the last 5 epoch checkpoints
run python -m fairseq_ext.average_checkpoints --inputs "$CKPT" --num-epoch-checkpoints 5 --output "$CKPT/checkpoint_avg5.pt"
# 5. beam 5, lenpen 1.0; tokenized case-insensitive BLEU
run_sh "fairseq-generate '$BIN' --user-dir '$ROOT/fairseq_ext' --task translation --source-lang $SRC --target-lang $TGT --path '$CKPT/checkpoint_avg5.pt' --gen-subset test --beam 5 --lenpen 1.0 --batch-size 128 --remove-bpe sentencepiece > '$OUT/generate-test.txt'"
run_sh "grep -P '^D-[0-9]+\t' '$OUT/generate-test.txt' | sed 's/^D-//' | sort -n -k1,1 | cut -f3 > '$OUT/test.hyp'"
run_sh "sacrebleu '$DATA_DIR/test.$TGT' -i '$OUT/test.hyp' --tokenize none -lc -m bleu -w 2 | tee '$OUT/bleu.json'"
