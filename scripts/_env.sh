# Sourced by scripts/bootstrap, scripts/test, scripts/regen and scripts/activate (bash or zsh): choose the Python
# environment Kiln lives in and put its bin/ first on PATH.
#
# * Inside an active virtual environment ($VIRTUAL_ENV) or a conda environment ($CONDA_PREFIX): that one.
# * Otherwise the project's own `.venv/` at the repository root (scripts/bootstrap creates it).
#
# The interpreter used to create `.venv` is `python3`, or `python` where only that exists.

kiln_repo_root() {
  # The repository root: the directory above scripts/.
  local here
  here="${BASH_SOURCE[0]:-${(%):-%x}}"
  (cd "$(dirname "$here")/.." && pwd)
}

kiln_base_python() {
  # A Python 3.11+ interpreter to create the project venv with.
  local candidate
  for candidate in python3 python; do
    if command -v "$candidate" >/dev/null 2>&1 \
      && "$candidate" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)' 2>/dev/null; then
      echo "$candidate"
      return 0
    fi
  done
  echo "error: Kiln needs Python 3.11 or newer as python3 (or python); none was found on PATH" >&2
  return 1
}

kiln_env_dir() {
  # The environment Kiln uses: an active venv/conda env, else <repo>/.venv (which may not exist yet).
  if [ -n "${VIRTUAL_ENV:-}" ] && [ -x "$VIRTUAL_ENV/bin/python" ]; then
    echo "$VIRTUAL_ENV"
  elif [ -n "${CONDA_PREFIX:-}" ] && [ -x "$CONDA_PREFIX/bin/python" ]; then
    echo "$CONDA_PREFIX"
  else
    echo "$(kiln_repo_root)/.venv"
  fi
}

kiln_use_env() {
  # Put the chosen environment's bin/ first on PATH; fail with the fix when it does not exist.
  local env_dir
  env_dir="$(kiln_env_dir)"
  if [ ! -x "$env_dir/bin/python" ]; then
    echo "error: no Python environment at $env_dir; run scripts/bootstrap first" >&2
    return 1
  fi
  case ":$PATH:" in
    *":$env_dir/bin:"*) ;;
    *) PATH="$env_dir/bin:$PATH" ;;
  esac
  export PATH
  if [ -z "${CONDA_PREFIX:-}" ] || [ "$env_dir" != "$CONDA_PREFIX" ]; then
    VIRTUAL_ENV="$env_dir"
    export VIRTUAL_ENV
  fi
}
