# Sourced by the set-up commands (scripts/demo.sh, scripts/test.sh): puts a Python environment with
# this checkout installed on PATH. Uses the active virtualenv if there is one, else ./.venv (made
# on first use with `python3 -m venv`; on Debian/Ubuntu without the venv module, and as root, it
# installs python3-venv from the machine's configured archive first, and g++ if there is no C++
# compiler). Then `pip install -e` with
# the extras given in ORTSPARSE_EXTRAS (default: none), which builds the native library.
set -euo pipefail
_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

_fail() { echo "ortsparse set-up: $*" >&2; exit 2; }

# apt-get install as root (the package lists are refreshed once if the first attempt fails, as on a
# fresh container); returns non-zero when not root, without apt-get, or when it fails.
_apt_install() {
  [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null || return 1
  echo "ortsparse set-up: installing $* with apt-get" >&2
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$@" >/dev/null 2>&1 && return 0
  apt-get update -q >/dev/null 2>&1 || true
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$@" >/dev/null
}

if ! command -v c++ >/dev/null && ! command -v g++ >/dev/null; then
  _apt_install g++ || _fail "no C++ compiler found; install one (Debian/Ubuntu: sudo apt-get install g++) and run again"
fi

if [ -z "${VIRTUAL_ENV:-}" ]; then
  if [ ! -x "$_root/.venv/bin/python" ]; then
    command -v python3 >/dev/null || _fail "python3 not found; install Python >= 3.10"
    python3 -c 'import sys; sys.exit(sys.version_info < (3, 10))' || _fail "Python >= 3.10 is needed, found $(python3 -V 2>&1)"
    if ! python3 -m venv "$_root/.venv" >/dev/null 2>&1; then
      rm -rf "$_root/.venv"
      _pyver=$(python3 -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
      _apt_install "python${_pyver}-venv" || _apt_install python3-venv ||
        _fail "python3 cannot create a virtual environment; install the venv module (Debian/Ubuntu: sudo apt-get install python3-venv) and run again"
      python3 -m venv "$_root/.venv" || _fail "python3 -m venv failed"
    fi
    "$_root/.venv/bin/python" -m pip install -q --upgrade pip
  fi
  # shellcheck disable=SC1091
  . "$_root/.venv/bin/activate"
fi
python -m pip install -q -e "$_root${ORTSPARSE_EXTRAS:+[$ORTSPARSE_EXTRAS]}"
