#!/usr/bin/env bash
# Run one cargo-fuzz (libFuzzer) target for a time budget.
#   scripts/fuzz.sh TARGET SECONDS [extra libFuzzer args...]
# TARGET: range_ops | c_api_ops | share_handle | transfer_wire (fuzz/fuzz_targets/). CI runs each for 60 s,
# c_api_ops on fixed arenas (grow_arenas=0), and once more with GPU_ARENA_FUZZ_GROW=1 (arenas
# that grow, the default).
# Needs cargo-fuzz (`cargo install cargo-fuzz --locked`) and a C++ compiler (libfuzzer-sys
# builds libFuzzer). The toolchain here is stable Rust: cargo-fuzz passes nightly-only flags
# (-Z...), so RUSTC_BOOTSTRAP=1 is set for this build only. No sanitizer (-s none: the code
# under test is safe Rust apart from the C API's pointer checks, and it triples the speed);
# debug assertions on (-a), so the pool's own debug-build checks run too.
# Exit status: 0 when the budget ran out with no crash; non-zero on a crash, which is saved
# under fuzz/artifacts/TARGET/ (reproduce: scripts/fuzz.sh TARGET 0 artifacts/TARGET/FILE; paths
# relative to fuzz/).
set -euo pipefail
cd "$(dirname "$0")/../fuzz"
target="${1:?usage: scripts/fuzz.sh TARGET SECONDS [libFuzzer args]}"
seconds="${2:?usage: scripts/fuzz.sh TARGET SECONDS [libFuzzer args]}"
shift 2
case "$target" in
  range_ops|c_api_ops|share_handle|transfer_wire) ;;
  *) echo "fuzz.sh: unknown target $target (range_ops, c_api_ops, share_handle, transfer_wire)" >&2; exit 2 ;;
esac
if ! cargo fuzz --version >/dev/null 2>&1; then
  echo "fuzz.sh: cargo-fuzz missing: cargo install cargo-fuzz --locked" >&2; exit 2
fi
export RUSTC_BOOTSTRAP=1
mkdir -p "corpus/$target"
if [ "$seconds" = 0 ] && [ "$#" -gt 0 ]; then
  # Reproduce: run the given inputs once each.
  exec cargo fuzz run -s none -a "$target" "$@"
fi
# Input length bounds the number of operations per input (as in the 10 M runs of
# bench/results/fuzz-2026-11-29.md): longer inputs run 4-6x slower for little new coverage.
case "$target" in
  range_ops) max_len=256 ;;
  c_api_ops) max_len=128 ;;
  *) max_len=4096 ;;
esac
cargo fuzz run -s none -a "$target" "corpus/$target" -- \
  -max_total_time="$seconds" -max_len="$max_len" -print_final_stats=1 "$@"
