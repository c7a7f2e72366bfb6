#!/usr/bin/env bash
# The Python package's tests: a fresh venv (build/python-venv), the test dependencies, `pip install .` built
# CPU-only (scripts/test.sh has compiled the CUDA code already; pass DMOE_PY_CUDA=AUTO to include it), pytest.
# torch is installed without its CUDA dependencies (scripts/requirements-torch.txt); when it cannot be installed or
# imported here, the torch and Hugging Face tests skip with a message and the numpy API tests still run.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=build/python-venv
python=${DMOE_PYTHON:-python3}
t0=$SECONDS
"$python" -m venv --clear "$venv"
"$venv/bin/pip" install -q -r scripts/requirements-python.txt
t1=$SECONDS
if "$venv/bin/pip" install -q --no-deps -r scripts/requirements-torch.txt &&
   "$venv/bin/python" -c "import torch; torch.ones(2).sum()"; then
  echo "test-python: torch $("$venv/bin/python" -c 'import torch; print(torch.__version__)') installed"
else
  echo "test-python: WARNING: torch could not be installed or imported here: the torch tests will skip" >&2
fi
t2=$SECONDS
"$venv/bin/pip" install -q . -Ccmake.define.DMOE_CUDA="${DMOE_PY_CUDA:-OFF}" -Cbuild-dir=build/python-wheel
t3=$SECONDS
# From a directory outside the source tree, so that `import dmoe` is the installed package, not python/dmoe.
(cd build && "$OLDPWD/$venv/bin/python" -m pytest -q -rs "$OLDPWD/tests/python")
t4=$SECONDS
echo "test-python: deps $((t1 - t0)) s, torch $((t2 - t1)) s, pip install . $((t3 - t2)) s, pytest $((t4 - t3)) s"
