#!/usr/bin/env bash
# Installs what dmoe needs to build: Debian packages (compiler, CMake, Ninja, GoogleTest, nlohmann-json,
# CLI11, fmt) and, where a CUDA toolkit is present, the wheels of scripts/requirements-gpu.txt from PyPI:
# NVSHMEM pinned to the GPU machine's version, and the header-only cudnn-frontend (its Python-side
# dependencies are not installed: --no-deps, only its headers are used). CUDA itself (nvcc, cuBLAS, NCCL)
# comes with the toolkit; cuDNN is loaded at run time. Safe to run again: installed packages are skipped.
set -euo pipefail
cd "$(dirname "$0")/.."

debs=(g++ cmake ninja-build python3 python3-pip python3-venv libgtest-dev nlohmann-json3-dev libcli11-dev libfmt-dev)
missing=()
for p in "${debs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  if command -v apt-get >/dev/null; then
    sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo"
    echo "install-deps: Debian packages: ${missing[*]}"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
  else
    echo "install-deps: no apt-get here; please install: ${missing[*]}" >&2
    exit 1
  fi
fi

nvcc_path=$(command -v nvcc || true)
[ -n "$nvcc_path" ] || [ ! -x /usr/local/cuda/bin/nvcc ] || nvcc_path=/usr/local/cuda/bin/nvcc
if [ -n "$nvcc_path" ]; then
  # Every pinned wheel installed at its version: nothing to do (pip would say so too, more slowly).
  wanted=$(grep -cE '^[A-Za-z]' scripts/requirements-gpu.txt)
  have=$(python3 -m pip freeze 2>/dev/null | grep -cxF -f <(grep -E '^[A-Za-z]' scripts/requirements-gpu.txt) || true)
  if [ "$have" -eq "$wanted" ]; then
    echo "install-deps: GPU wheels already present (NVSHMEM, cudnn-frontend)"
  else
    echo "install-deps: GPU wheels from PyPI (scripts/requirements-gpu.txt: NVSHMEM, cudnn-frontend)"
    python3 -m pip install -q --no-deps -r scripts/requirements-gpu.txt 2>/dev/null ||
      python3 -m pip install -q --no-deps --break-system-packages -r scripts/requirements-gpu.txt
  fi
else
  echo "install-deps: no CUDA toolkit found: CPU-only build"
fi
