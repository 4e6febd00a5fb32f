#!/usr/bin/env bash
# Builds examples/cpp against the hprt C library of the current cargo profile and runs it.
# Usage: examples/cpp/run.sh [debug|release]   (builds the library first, as shipped: the package
# `hprt` alone, without the tooling of hprt-cli)
set -euo pipefail
cd "$(dirname "$0")/../.."
profile="${1:-debug}"
flags=()
[ "$profile" = release ] && flags=(--release)
flags+=(-p hprt --lib)
cargo build "${flags[@]}" 2>/dev/null || cargo build "${flags[@]}"
target="${CARGO_TARGET_DIR:-target}"
[[ "$target" = /* ]] || target="$(pwd)/$target"
lib="$target/$profile"
out="$lib/examples-cpp"
mkdir -p "$out"
c++ -std=c++17 -Wall -Wextra -Werror -O1 -Iinclude examples/cpp/main.cpp \
  -L"$lib" -lhprt -Wl,-rpath,"$lib" -pthread -o "$out/hprt_example"
"$out/hprt_example"
