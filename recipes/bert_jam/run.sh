# Sourced by recipes/bert_jam/common.sh and ding_de_en.sh: run a step, or with DRY_RUN=1 print it instead
# (one line, shell-quoted), which is what the recipes' --dry-run shows and tests/core/test_recipes.py parses.
run() {
  if [ "$DRY_RUN" = 1 ]; then printf '%q ' "$@"; printf '\n'; else "$@"; fi
}
# run_sh "command line" (pipes, redirections): print it with --dry-run, else run it with bash
run_sh() {
  if [ "$DRY_RUN" = 1 ]; then printf '%s\n' "$1"; else bash -c "set -euo pipefail; $1"; fi
}
