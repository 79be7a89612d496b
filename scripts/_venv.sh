# Sourced by demo.sh, docs.sh and example.sh (not run on its own): make .venv if it is missing
# and install into it what the calling script needs, saying what and how long, unless
# CHECK (Python code) already runs there.
#   venv_install CHECK PIP_SPEC WHAT
venv_install() {
  local check=$1 spec=$2 what=$3 start
  if [ ! -x .venv/bin/python ]; then
    "${PYTHON:-python3}" -m venv .venv
  fi
  if ! .venv/bin/python -c "$check" 2>/dev/null; then
    echo "installing $what into .venv ..." >&2
    start=$SECONDS
    .venv/bin/python -m pip install --quiet --disable-pip-version-check -c constraints.txt -e "$spec"
    echo "installed in $((SECONDS - start)) s" >&2
  fi
}
