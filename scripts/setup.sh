#!/usr/bin/env bash
# Sets zerofn up in this checkout: installs what zerofn and its tests need, then builds the
# C++ extension and installs zerofn editable (`pip install -e .`), all into the interpreter
# scripts/python.sh chooses: an active virtual or conda environment's, else .venv here,
# made on the first run. Only what is missing is installed, and the build runs again only
# when its sources changed, so a second run installs nothing. A machine with everything
# already importable (a GPU machine with no package index) sets up offline. torch is
# pinned only where none is importable: a GPU machine keeps its own build.
#   bash scripts/setup.sh             set up (the first run takes a few minutes)
#   bash scripts/setup.sh --dry-run   print the interpreter chosen and whether .venv would
#                                     be made, and change nothing
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/python.sh

# "import name=pip requirement" pairs: the core, the build, then the tests' extras.
NEEDS=(
  "torch=torch==2.13.0"
  "torchdata=torchdata" "tensorboard=tensorboard" "safetensors=safetensors"
  "pybind11=pybind11" "setuptools=setuptools" "wheel=wheel"
  "pytest=pytest" "xdist=pytest-xdist" "hypothesis=hypothesis"
  "nbclient=nbclient" "ipykernel=ipykernel"
  "matplotlib=matplotlib" "transformers=transformers>=5,<6" "accelerate=accelerate"
  "sphinx=sphinx>=9,<10" "furo=furo>=2025,<2027"
  "lightning=lightning>=2.6,<2.7" "torchao=torchao>=0.18,<0.19"
)

die() { echo "setup: $*" >&2; exit 1; }

case ${1:-} in
  "" | --dry-run) ;;
  *) die "unknown argument $1 (only --dry-run)" ;;
esac

# Stops unless interpreter $1 runs and is at least pyproject.toml's requires-python.
check_python() {
  local floor
  floor=$(sed -n -E 's/^requires-python = ">=([0-9.]+)"/\1/p' pyproject.toml)
  "$1" -c "" 2>/dev/null ||
    die "cannot run $1: install Python $floor or later, or choose one: PYTHON=/path/to/python"
  "$1" -c "import sys; sys.exit(sys.version_info < tuple(map(int, sys.argv[1].split('.'))))" \
      "$floor" ||
    die "$1 is Python $("$1" -c 'import platform; print(platform.python_version())');" \
        "zerofn needs $floor or later: choose one with PYTHON=/path/to/python"
}

# Stops where the existing .venv cannot serve: PYTHON names another interpreter than the
# one it was made from (as its pyvenv.cfg says: venv writes `executable`, virtualenv
# `base-executable`), or it no longer runs.
check_venv() {
  local made_from chosen
  made_from=$(sed -n -E 's/^(executable|base-executable) *= *//p' "$ZEROFN_VENV/pyvenv.cfg" \
                2>/dev/null | head -n 1)
  if [[ -n ${PYTHON:-} && -n $made_from ]]; then
    chosen=$("$PYTHON" -c 'import os, sys; print(os.path.realpath(sys.executable))')
    [[ $(readlink -f "$made_from") == "$chosen" ]] ||
      die ".venv was made from $made_from, not PYTHON=$PYTHON: remove it (rm -rf .venv) to" \
          "make it again from $PYTHON, or leave PYTHON unset to use it"
  fi
  "$ZEROFN_VENV/bin/python" -c "" 2>/dev/null ||
    die "$ZEROFN_VENV/bin/python does not run (its interpreter gone?): rm -rf .venv and run again"
}

# .venv from interpreter $1, seeing its packages where $2 is "yes".
make_venv() {
  local flags=()
  if [[ $2 == yes ]]; then flags=(--system-site-packages); fi
  echo "setup: making .venv from $1 ${flags[*]}" >&2
  if ! "$1" -m venv "${flags[@]}" "$ZEROFN_VENV"; then
    rm -rf "$ZEROFN_VENV"
    die "could not make .venv with $1 -m venv (on Debian or Ubuntu: apt-get install" \
        "python3-venv). Or activate a virtual or conda environment, or choose an" \
        "interpreter that has one: PYTHON=/path/to/python"
  fi
}

# The NEEDS that $PY cannot import, as pip requirements on one line: one interpreter tries
# every import.
missing_requirements() {
  "$PY" - "${NEEDS[@]}" <<'EOF'
import importlib, sys
for pair in sys.argv[1:]:
    name, requirement = pair.split("=", 1)
    try:
        importlib.import_module(name)
    except Exception:
        print(requirement, end=" ")
EOF
}

# pip-installs requirements $@ into $PY: torch first and alone, so the rest never pull
# another build of it; then the rest, going on without them where that fails (offline: a
# GPU machine with no index; the tests needing them skip and say why).
install_missing() {
  local req rest=()
  if (($#)); then
    echo "setup: installing into $PY: $* (the first time, a few minutes)" >&2
  fi
  for req in "$@"; do
    if [[ $req == torch==* ]]; then
      "$PY" -m pip install -q "$req" ||
        die "could not install $req (no package index?): install a torch first, or choose" \
            "an interpreter that has one: PYTHON=/path/to/python"
    else
      rest+=("$req")
    fi
  done
  if ((${#rest[@]})) && ! "$PY" -m pip install -q "${rest[@]}"; then
    echo "setup: could not install ${rest[*]}; continuing without them" >&2
  fi
}

# Whether zerofn imports from this checkout with no help (outside it, no PYTHONPATH), and
# its extension is newer than every file it is built from: then there is nothing to build.
installed_and_built() {
  (cd / && env -u PYTHONPATH "$PY" - "$ZEROFN_ROOT" <<'EOF'
import glob, os, sys
root = os.path.realpath(sys.argv[1])
try:
    import zerofn, zerofn._C
except Exception:
    sys.exit(1)
sources = glob.glob(os.path.join(root, "cpp", "*")) + [
    os.path.join(root, name) for name in ("setup.py", "pyproject.toml")]
sys.exit(os.path.realpath(zerofn.__file__) != os.path.join(root, "zerofn", "__init__.py")
         or os.path.getmtime(zerofn._C.__file__) < max(map(os.path.getmtime, sources)))
EOF
  )
}

# Which interpreter, and whether .venv is to be made (and from what): decided before
# anything changes, so that --dry-run prints exactly what a run does.
chosen=$(zerofn_chosen_python)
check_python "$chosen"
PY=$(zerofn_python)
venv=none site=no
if [[ $PY == "$ZEROFN_VENV/bin/python" && -e $ZEROFN_VENV ]]; then
  venv=exists
  check_venv
elif [[ $PY == "$ZEROFN_VENV/bin/python" ]]; then
  venv=make
  # Where the chosen interpreter imports torch already (a GPU machine's own CUDA build),
  # .venv sees its packages (--system-site-packages), so that build is used rather than
  # replaced by torch==2.13.0 from the index. Elsewhere .venv starts empty.
  if "$chosen" -c "import torch" 2>/dev/null; then site=yes; fi
fi
if [[ ${1:-} == --dry-run ]]; then
  printf 'python=%s\nvenv=%s\nbase=%s\nsystem_site_packages=%s\n' "$PY" "$venv" "$chosen" "$site"
  exit 0
fi

if [[ $venv == make ]]; then make_venv "$chosen" "$site"; fi
read -ra missing <<<"$(missing_requirements)"
install_missing "${missing[@]}"
if ! installed_and_built; then
  echo "setup: building zerofn and installing it editable into $PY (a minute or two)" >&2
  "$PY" -m pip install -q --no-build-isolation --no-deps -e .
fi
# Bytecode for the checkout's sources (only what changed since): where the environment
# sets PYTHONDONTWRITEBYTECODE (as CI's image does) no process would keep its compiled
# zerofn, and each would compile it again on start.
"$PY" -m compileall -q zerofn tests tools >/dev/null
echo "setup: zerofn is set up in $PY" >&2
