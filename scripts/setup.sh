#!/usr/bin/env bash
# One command on a fresh machine: install dependencies, build, run the main job.
# The main job is `dmoe bench`: on a machine without a GPU it times the CPU reference engine at 1 and 4
# simulated ranks and checks them against each other; it also runs a small init → run round trip
# through safetensors files under out/.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
cmake --preset default
cmake --build --preset default -j"$(nproc)"

mkdir -p out
./build/dmoe init --tokens 32 --hidden 128 --ffn 256 --experts 8 --top-k 2 --world 4 \
  --out out/weights.safetensors --input out/x.safetensors --grad-output out/dy.safetensors \
  --save-config out/config.json
./build/dmoe run --config out/config.json --weights out/weights.safetensors --input out/x.safetensors \
  --grad-output out/dy.safetensors --output out/y.safetensors
./build/dmoe bench --json out/bench.json
