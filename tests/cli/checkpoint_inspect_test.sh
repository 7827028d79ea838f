#!/bin/sh
# zest checkpoint inspect: the summary of a checkpoint whose contents are known (2 ranks, 64-byte
# chunks: 35 per file), exit 0 intact, 1 with each problem named (a flipped byte, a truncated file),
# 2 for an unreadable manifest or bad usage; zest checkpoint consolidate's exit codes and messages.
# usage: checkpoint_inspect_test.sh ZEST MAKE_TEST_CHECKPOINT
set -eu

zest=${1:?usage: checkpoint_inspect_test.sh ZEST MAKE_TEST_CHECKPOINT}
make_checkpoint=${2:?usage: checkpoint_inspect_test.sh ZEST MAKE_TEST_CHECKPOINT}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

. "$(dirname "$0")/expect.sh"

# 1100 values, 2200 bytes per rank and state: 35 chunks of 64 bytes per file, 6 files.
ckpt="$work/ckpt"
"$make_checkpoint" "$ckpt" 2 64 10x100:layer.0.weight 99:layer.0.bias :scale

# --- intact: the summary, then every chunk verified, exit 0
run checkpoint inspect "$ckpt"
expect_rc 0 "intact"
expect_line "$work/out" "checkpoint $ckpt" "intact"
expect_line "$work/out" "  format version 4, saved by 2 ranks at stage 3" "intact"
expect_line "$work/out" "  optimizer states: master fp32, m and v fp32" "intact"
expect_line "$work/out" "  steps 7 (1 skipped), loss scale 256" "intact"
expect_line "$work/out" "  config: stage=3 dtype=fp32 writer=synthetic_checkpoint" "intact"
expect_line "$work/out" "  checksum chunk: 64B" "intact"
expect_line "$work/out" "tensors: 3, 1100 values (4400 bytes of fp32 weights)" "intact"
expect_line "$work/out" "  name            shape      group  numel" "intact"
expect_line "$work/out" "  layer.0.weight  [10, 100]  0      1000" "intact"
expect_line "$work/out" "  layer.0.bias    [99]       1      99" "intact"
expect_line "$work/out" "  scale           []         2      1" "intact"
expect_line "$work/out" "files: 6, 13200 bytes in 210 chunks" "intact"
expect_line "$work/out" "  rank0.master.bin  2200   35" "intact"
expect_line "$work/out" "  rank1.v.bin       2200   35" "intact"
expect_line "$work/out" "checksums: 210 chunks in 6 files verified, all intact" "intact"
[ ! -s "$work/err" ] || fail "intact: unexpected stderr: $(cat "$work/err")"

# --- damaged: a flipped byte in chunk 2 of one file, another file truncated; both named, exit 1
cp -r "$ckpt" "$work/bad"
printf 'X' | dd of="$work/bad/rank1.master.bin" bs=1 seek=130 conv=notrunc 2>/dev/null
head -c 100 "$ckpt/rank0.v.bin" >"$work/bad/rank0.v.bin"
run checkpoint inspect "$work/bad"
expect_rc 1 "damaged"
expect_text "$work/out" "damaged: checkpoint $work/bad: rank file $work/bad/rank1.master.bin chunk 2 (bytes 128 to 192) has CRC32C" "damaged"
expect_line "$work/out" "damaged: $work/bad/rank0.v.bin: 100 bytes, the manifest says 2200" "damaged"
expect_text "$work/out" "checksums: 2 problems in 6 files: the checkpoint is damaged; load an earlier checkpoint" "damaged"

# --no-verify reads only the manifest.
run checkpoint inspect "$work/bad" --no-verify
expect_rc 0 "--no-verify"
expect_line "$work/out" "checksums: not verified (--no-verify)" "--no-verify"

# Consolidation reads only the weights: a truncated v file does not stop it, damaged weights do.
run checkpoint consolidate "$work/bad" "$work/bad.safetensors"
expect_rc 1 "consolidate damaged weights"
expect_text "$work/err" "$work/bad/rank1.master.bin chunk 2 (bytes 128 to 192)" "consolidate damaged weights"
cp "$ckpt/rank1.master.bin" "$work/bad/rank1.master.bin"
run checkpoint consolidate "$work/bad" "$work/bad.safetensors"
expect_rc 0 "consolidate with only Adam's v truncated"
rm "$work/bad.safetensors"
[ -z "$(ls "$work" | grep safetensors)" ] || fail "a failed consolidate left $(ls "$work" | grep safetensors)"

run checkpoint consolidate "$ckpt" "$work/w.safetensors" --dtype bf16
expect_rc 0 "consolidate"
expect_line "$work/out" "wrote 3 tensors (bf16, $(wc -c <"$work/w.safetensors" | tr -d ' ') bytes) to $work/w.safetensors" "consolidate"

# --- an unreadable manifest: exit 2, saying which file and why
run checkpoint inspect "$work/none"
expect_rc 2 "no checkpoint"
expect_text "$work/err" "$work/none/manifest" "no checkpoint"
expect_text "$work/err" "No such file or directory" "no checkpoint"
sed 's/^steps 7$/steps 8/' "$ckpt/manifest" >"$work/bad/manifest"
run checkpoint inspect "$work/bad"
expect_rc 2 "edited manifest"
expect_text "$work/err" "its CRC32C does not match its contents" "edited manifest"

# --- usage
for args in "checkpoint" "checkpoint list" "checkpoint inspect" "checkpoint inspect $ckpt $ckpt" \
            "checkpoint inspect $ckpt --fast" "checkpoint consolidate $ckpt" \
            "checkpoint consolidate $ckpt $work/x --dtype f8" "checkpoint consolidate $ckpt $work/x --dtype"; do
  # shellcheck disable=SC2086 # split on purpose
  run $args
  expect_rc 2 "usage: zest $args"
  expect_text "$work/err" "usage: zest checkpoint inspect DIR" "usage: zest $args"
done
run checkpoint --help
expect_rc 0 "--help"
run --help
expect_text "$work/out" "checkpoint consolidate DIR OUT" "zest --help"

if [ "$failures" -ne 0 ]; then
  echo "$failures check(s) failed" >&2
  exit 1
fi
echo "checkpoint inspect/consolidate: all checks passed"
