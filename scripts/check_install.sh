#!/usr/bin/env bash
# check_install.sh BUILD_DIR — dmoe as installed, the way a new user meets it:
#   1. `cmake --install BUILD_DIR` into a temporary prefix, then moves the prefix elsewhere (an install must
#      not depend on where it was first put);
#   2. configures, builds and runs examples/consumer against it (find_package(dmoe CONFIG), dmoe::dmoe);
#   3. runs the installed `dmoe` from an unrelated directory with named configs, and checks that the one it
#      read came from the install's share/dmoe (the source tree, compiled in as the last place to look,
#      has the same names).
# Called by scripts/test.sh on the `default` build; exits non-zero at the first failure.
set -euo pipefail
cd "$(dirname "$0")/.."
src=$PWD
build=${1:?usage: scripts/check_install.sh BUILD_DIR}
[ -f "$build/cmake_install.cmake" ] || { echo "check_install: $build is not a configured dmoe build" >&2; exit 1; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

echo "check_install: cmake --install $build"
cmake --install "$build" --prefix "$tmp/first-place" > "$tmp/install.log"
mv "$tmp/first-place" "$tmp/prefix"
prefix=$tmp/prefix
for f in bin/dmoe include/dmoe/dmoe.hpp include/dmoe/core/config.hpp lib/cmake/dmoe/dmoeConfig.cmake \
         share/dmoe/bench/configs/cpu-small.json share/dmoe/bench/models/tiny.json share/dmoe/bench/flow/example.json \
         share/dmoe/bench/peers.py; do
  [ -e "$prefix/$f" ] || { echo "check_install: the install has no $f" >&2; exit 1; }
done

echo "check_install: examples/consumer against the installed package"
cmake -S examples/consumer -B "$tmp/consumer" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$prefix" \
  > "$tmp/consumer-configure.log" || { cat "$tmp/consumer-configure.log"; exit 1; }
grep "dmoe .* from" "$tmp/consumer-configure.log" || true
cmake --build "$tmp/consumer" -j"$(nproc)" > "$tmp/consumer-build.log" || { cat "$tmp/consumer-build.log"; exit 1; }
"$tmp/consumer/dmoe_consumer"

echo "check_install: the installed dmoe from another directory, named configs, DMOE_HOME unset"
mkdir "$tmp/work"
cd "$tmp/work"
dmoe() { env -u DMOE_HOME "$prefix/bin/dmoe" "$@"; }
dmoe --version
dmoe init --config cpu-small --out w.safetensors --input x.safetensors --grad-output dy.safetensors
dmoe run --config cpu-small --weights w.safetensors --input x.safetensors --grad-output dy.safetensors \
  --output y.safetensors
dmoe init-model --config tiny --out model.safetensors
out=$(dmoe flow simulate --costs example --schedule vanilla)
echo "$out" | head -1
case "$out" in
  *"$prefix/share/dmoe/bench/flow/example.json"*) ;;
  *) echo "check_install: the named cost file was not read from $prefix/share/dmoe" >&2; exit 1 ;;
esac
# A name found nowhere: the error lists the places looked at, the install's data folder among them.
if out=$(dmoe init --config no-such-config --out n.safetensors 2>&1); then
  echo "check_install: an unknown named config was accepted" >&2; exit 1
fi
case "$out" in
  *"$prefix/share/dmoe/bench/configs/no-such-config.json (the install's data folder"*) ;;
  *) echo "check_install: unexpected error for an unknown config: $out" >&2; exit 1 ;;
esac
cd "$src"
echo "check_install: ok"
