#!/usr/bin/env bash
# Lossless speculative decoding of the release transformer (releases/bible-de-en/transformer.pt) with a SAT drafter
# (--sat-draft-path, fairseq_ext/sat/speculative.py; docs/sat_speculative.md):
#   1. the drafter: the verifier's greedy translations of the Bible training set, a sat_transformer trained on them
#      from the verifier's weights with its encoder frozen (tools/train_drafter.py, one thread);
#   2. the Acts test set decoded greedily by the verifier alone and with the drafter (fairseq-generate, batch 64);
#   3. the two outputs compared line by line (they must be identical);
#   4. the benchmark: batch-1 latency, accepted drafts per call, batch-64 throughput, CTranslate2 beside them.
#
#   bash recipes/sat/speculative.sh [--workdir DIR] [--k 2] [--decoder-layers 3] [--max-update 3000] [--dry-run]
#
#   --workdir         default work/speculative
#   --k               the drafter's group size (words drafted per verifier call; default 2)
#   --decoder-layers  the drafter's decoder layers (default 3: the verifier's)
#   --max-update      the drafter's training updates (default 3000)
#   --dry-run         print every command without running anything
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
RELEASE="$ROOT/releases/bible-de-en"
WORKDIR="work/speculative"; K=2; LAYERS=3; UPDATES=3000; DRY_RUN=0
while [ $# -gt 0 ]; do
  case "$1" in
    --workdir) WORKDIR="$2"; shift 2 ;;
    --k) K="$2"; shift 2 ;;
    --decoder-layers) LAYERS="$2"; shift 2 ;;
    --max-update) UPDATES="$2"; shift 2 ;;
    --dry-run) DRY_RUN=1; shift ;;
    -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
    *) echo "speculative.sh: unknown option '$1' (see --help)" >&2; exit 2 ;;
  esac
done
source "$(dirname "${BASH_SOURCE[0]}")/run.sh"
DRAFTER="$WORKDIR/drafter/checkpoints/checkpoint_avg.pt"
BIN="$WORKDIR/drafter/bin"
GEN=(fairseq-generate "$BIN" --user-dir "$ROOT/fairseq_ext" --task translation_sat --source-lang de --target-lang en
  --path "$RELEASE/transformer.pt" --gen-subset test --beam 1 --max-len-a 1.2 --max-len-b 10 --batch-size 64
  --num-workers 0)

echo "== 1/4 the drafter (K=$K, $LAYERS decoder layers, $UPDATES updates, one thread) =="
run python "$ROOT/tools/train_drafter.py" --verifier "$RELEASE/transformer.pt" --k "$K" --decoder-layers "$LAYERS" \
  --init-decoder --freeze-encoder --max-update "$UPDATES" --workdir "$WORKDIR/drafter"

echo "== 2/4 the Acts test set: the verifier alone, then with the drafter =="
run_to "$WORKDIR/greedy.txt" "${GEN[@]}"
run_to "$WORKDIR/speculative.txt" "${GEN[@]}" --sat-draft-path "$DRAFTER"

echo "== 3/4 the outputs must be identical =="
run_to "$WORKDIR/greedy.hyp" grep -P '^H-' "$WORKDIR/greedy.txt"
run_to "$WORKDIR/speculative.hyp" grep -P '^H-' "$WORKDIR/speculative.txt"
run python -c "import sys; a, b = ([l.split('\t')[::2] for l in open(f)] for f in sys.argv[1:]); \
d = sum(x != y for x, y in zip(sorted(a), sorted(b))); print(f'{len(a)} lines, {d} differ'); sys.exit(d > 0)" \
  "$WORKDIR/greedy.hyp" "$WORKDIR/speculative.hyp"

echo "== 4/4 the benchmark (batch 1 and 64, one thread) =="
run env PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" python -m benchmarks.speed.speculative --workdir "$WORKDIR/bench" \
  --drafter "drafter=$DRAFTER" --json "$WORKDIR/bench.json"
