# Sourced by setup.sh, train.sh and test.sh: which Python interpreter they run, so the three
# agree. PYTHON=/path/to/python chooses it; else an active virtual environment's
# (VIRTUAL_ENV) or conda environment's (CONDA_PREFIX); else python3 on the PATH. One
# inside a virtual or conda environment is used as it is. Any other (a system's, pyenv's)
# only makes .venv in the checkout, which is used instead: Debian's and Ubuntu's Python
# refuses pip installs (PEP 668), and an editable install into an interpreter that other
# checkouts share would point all of them at whichever one set up last.

ZEROFN_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
ZEROFN_VENV=$ZEROFN_ROOT/.venv

# The interpreter chosen: PYTHON, an active environment's, or python3 (its path).
zerofn_chosen_python() {
  if [[ -n ${PYTHON:-} ]]; then
    echo "$PYTHON"
  elif [[ -n ${VIRTUAL_ENV:-} && -x $VIRTUAL_ENV/bin/python ]]; then
    echo "$VIRTUAL_ENV/bin/python"
  elif [[ -n ${CONDA_PREFIX:-} && -x $CONDA_PREFIX/bin/python ]]; then
    echo "$CONDA_PREFIX/bin/python"
  else
    command -v python3 || echo python3
  fi
}

# Whether interpreter $1 runs inside a virtual environment (its prefix is not its base's)
# or a conda environment (conda-meta/ in its prefix). False where it does not run at all.
zerofn_in_env() {
  "$1" -c 'import os, sys
sys.exit(not (sys.prefix != sys.base_prefix or os.path.isdir(os.path.join(sys.prefix, "conda-meta"))))' \
    2>/dev/null
}

# The interpreter the scripts run: the chosen one where it is in an environment, else
# .venv's (setup.sh makes .venv on its first run).
zerofn_python() {
  local chosen
  chosen=$(zerofn_chosen_python)
  if zerofn_in_env "$chosen"; then echo "$chosen"; else echo "$ZEROFN_VENV/bin/python"; fi
}
