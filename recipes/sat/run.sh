# Sourced by the SAT recipes: run prints a step (shell-quoted) and runs it unless DRY_RUN=1; run_to FILE sends its
# standard output to FILE.
run() {
  printf '+'; printf ' %q' "$@"; printf '\n'
  if [ "$DRY_RUN" != 1 ]; then "$@"; fi
}
run_to() {
  local out="$1"; shift
  printf '+'; printf ' %q' "$@"; printf ' > %q\n' "$out"
  if [ "$DRY_RUN" != 1 ]; then "$@" > "$out"; fi
}
