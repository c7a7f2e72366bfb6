#!/usr/bin/env bash
# The Python package's tests: a fresh venv (build/python-venv), the test dependencies, `pip install .` built
# CPU-only (scripts/test.sh has compiled the CUDA code already; pass DMOE_PY_CUDA=AUTO to include it), pytest.
# torch is installed without its CUDA dependencies (scripts/requirements-torch.txt); when it cannot be installed or
# imported here, the torch and Hugging Face tests skip with a message and the numpy API tests still run.
#
#   scripts/test-python.sh            all of it
#   scripts/test-python.sh prepare    only the venv and its dependencies (downloads: scripts/test.sh runs this in
#                                     the background while it compiles)
#   scripts/test-python.sh test       only the package build and pytest, in a venv `prepare` made
set -euo pipefail
cd "$(dirname "$0")/.."
venv=build/python-venv
python=${DMOE_PYTHON:-python3}
what=${1:-all}
case $what in all | prepare | test) ;; *) echo "test-python.sh: unknown step '$what'; allowed: all, prepare, test" >&2; exit 2 ;; esac

if [ "$what" != test ]; then
  t0=$SECONDS
  mkdir -p build
  "$python" -m venv --clear "$venv"
  "$venv/bin/pip" install -q -r scripts/requirements-python.txt
  t1=$SECONDS
  if "$venv/bin/pip" install -q --no-deps -r scripts/requirements-torch.txt &&
     "$venv/bin/python" -c "import torch; torch.ones(2).sum()"; then
    echo "test-python: torch $("$venv/bin/python" -c 'import torch; print(torch.__version__)') installed"
  else
    echo "test-python: WARNING: torch could not be installed or imported here: the torch tests will skip" >&2
  fi
  echo "test-python: deps $((t1 - t0)) s, torch $((SECONDS - t1)) s"
fi

if [ "$what" != prepare ]; then
  [ -x "$venv/bin/python" ] || { echo "test-python.sh test: no venv at $venv; run 'scripts/test-python.sh prepare' first" >&2; exit 2; }
  t2=$SECONDS
  "$venv/bin/pip" install -q . -Ccmake.define.DMOE_CUDA="${DMOE_PY_CUDA:-OFF}" -Cbuild-dir=build/python-wheel
  t3=$SECONDS
  # From a directory outside the source tree, so that `import dmoe` is the installed package, not python/dmoe.
  (cd build && "$OLDPWD/$venv/bin/python" -m pytest -q -rs "$OLDPWD/tests/python")
  echo "test-python: pip install . $((t3 - t2)) s, pytest $((SECONDS - t3)) s"
fi
