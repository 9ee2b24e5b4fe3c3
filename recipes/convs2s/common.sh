# Shared by the ConvS2S recipes (sourced, not run). Each step runs once: a finished step leaves
# $WORKDIR/.done.<step>, so re-running a recipe resumes after the last finished step (and fairseq-train itself
# resumes from checkpoint_last.pt). With --dry-run every command is printed instead of run.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
DRY_RUN=0
THREADS="${THREADS:-8}"
EXTRA_TRAIN_ARGS=()

usage() { sed -n '2,/^$/p' "$0" | sed 's/^# \{0,1\}//'; }

parse_args() {
  while [ $# -gt 0 ]; do
    case "$1" in
      --workdir) WORKDIR="$2"; shift 2 ;;
      --dry-run) DRY_RUN=1; shift ;;
      --threads) THREADS="$2"; shift 2 ;;
      -h|--help) usage; exit 0 ;;
      --) shift; EXTRA_TRAIN_ARGS=("$@"); break ;;
      *) echo "$(basename "$0"): unknown option '$1' (see --help; fairseq-train flags go after --)" >&2; exit 2 ;;
    esac
  done
  if [ -x "$ROOT/.venv/bin/python" ]; then export PATH="$ROOT/.venv/bin:$PATH"; fi
  USER_DIR="$ROOT/fairseq_ext"
}

# sh "command line": run it with bash (pipes, redirections), or print it with --dry-run
sh() {
  if [ "$DRY_RUN" = 1 ]; then printf '%s\n' "$1"; else bash -c "set -euo pipefail; $1"; fi
}

# step NAME FUNCTION: run FUNCTION unless NAME finished before
step() {
  local name="$1" fn="$2"
  if [ "$DRY_RUN" = 0 ] && [ -f "$WORKDIR/.done.$name" ]; then
    printf '\n==> %s: done before, skipped (delete %s to redo)\n' "$name" "$WORKDIR/.done.$name"
    return
  fi
  printf '\n==> %s\n' "$name"
  "$fn"
  if [ "$DRY_RUN" = 0 ]; then touch "$WORKDIR/.done.$name"; fi
}

# the tools of the standard preparation scripts (fairseq examples/translation/prepare-*.sh)
get_tools() {
  sh "mkdir -p '$WORKDIR/tools'"
  sh "[ -d '$WORKDIR/tools/mosesdecoder' ] || git clone --depth 1 https://github.com/moses-smt/mosesdecoder.git '$WORKDIR/tools/mosesdecoder'"
  sh "[ -d '$WORKDIR/tools/subword-nmt' ] || git clone --depth 1 https://github.com/rsennrich/subword-nmt.git '$WORKDIR/tools/subword-nmt'"
}

# the fairseq-train flags given after --, shell-quoted for sh
extra_train_args() { if [ ${#EXTRA_TRAIN_ARGS[@]} -gt 0 ]; then printf ' %q' "${EXTRA_TRAIN_ARGS[@]}"; fi; }

MOSES_SCRIPTS() { echo "$WORKDIR/tools/mosesdecoder/scripts"; }
BPE_TOOLS() { echo "$WORKDIR/tools/subword-nmt/subword_nmt"; }
