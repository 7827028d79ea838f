#!/bin/sh
# Nothing of the user's is lost: `zest-train --save` refuses, before training, a path that is not a
# zest checkpoint (a directory of the user's, a regular file) and leaves it as it was;
# `zest checkpoint consolidate` refuses an output inside the checkpoint it reads, a FIFO, a device,
# a symbolic link, a directory, '.', '..', '' and an existing file zest did not write, before any
# work and leaving it as it was, and replaces a safetensors file it wrote; and a FIFO named
# `manifest` is refused by inspect, consolidate and `zest-train --load` instead of hanging them;
# consolidate past the file-size limit fails with an error and leaves no temporary file; a
# checkpoint past 2^31 steps resumes without wrapping, and one of stage 9 is refused by name.
# usage: checkpoint_safety_test.sh ZEST MAKE_TEST_CHECKPOINT ZEST_TRAIN SOURCE_ROOT
set -eu

zest=${1:?usage: checkpoint_safety_test.sh ZEST MAKE_TEST_CHECKPOINT ZEST_TRAIN SOURCE_ROOT}
make_checkpoint=${2:?}
zest_train=${3:?}
config="${4:?}/configs/train-tiny.yaml"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

. "$(dirname "$0")/expect.sh"

# Every command here must end quickly: a hang is a failure, not a stuck test.
run() {
  rc=0
  timeout 60 "$zest" "$@" >"$work/out" 2>"$work/err" </dev/null || rc=$?
}
run_train() {
  rc=0
  timeout 60 "$zest_train" --config "$config" --steps 2 "$@" >"$work/out" 2>"$work/err" </dev/null || rc=$?
}
# unchanged FILE COPY WHAT: FILE still holds what COPY holds.
unchanged() {
  cmp -s "$1" "$2" || fail "$3: $1 was changed"
}

# --- zest-train --save: a directory of the user's, and a regular file, refused before training
mkdir "$work/mine"
echo "my notes" >"$work/mine/notes.txt"
cp "$work/mine/notes.txt" "$work/notes.copy"
run_train --save "$work/mine"
expect_rc 1 "save onto a user's directory"
expect_text "$work/err" "$work/mine is a directory that is not a zest checkpoint" "save onto a user's directory"
expect_text "$work/err" "save to another path, or move it away first" "save onto a user's directory"
grep -q "^step " "$work/out" && fail "save onto a user's directory: it trained before refusing"
unchanged "$work/mine/notes.txt" "$work/notes.copy" "save onto a user's directory"
[ "$(ls "$work/mine")" = "notes.txt" ] || fail "save onto a user's directory: it holds $(ls "$work/mine")"

echo "weights" >"$work/model.pt"
cp "$work/model.pt" "$work/model.copy"
run_train --save "$work/model.pt"
expect_rc 1 "save onto a regular file"
expect_text "$work/err" "$work/model.pt is a regular file, not a directory" "save onto a regular file"
unchanged "$work/model.pt" "$work/model.copy" "save onto a regular file"
ls -d "$work"/*.tmp-* >/dev/null 2>&1 && fail "refused saves left temporary directories: $(ls -d "$work"/*.tmp-*)"

# Its own checkpoint is replaced: two saves to one path, the second resumed from the first.
run_train --save "$work/ckpt"
expect_rc 0 "first save"
run_train --load "$work/ckpt" --save "$work/ckpt"
expect_rc 0 "a save replacing its own checkpoint"
[ "$(ls "$work/ckpt" | tr '\n' ' ')" = "manifest rank0.m.bin rank0.master.bin rank0.v.bin " ] ||
  fail "replaced checkpoint holds: $(ls "$work/ckpt")"

# --- consolidate: outputs that are the checkpoint's own files, or inside it
ckpt="$work/synthetic"
"$make_checkpoint" "$ckpt" 2 64 10x100:w 99:b
cp -r "$ckpt" "$work/synthetic.copy"
for out in "$ckpt/manifest" "$ckpt/rank0.master.bin" "$ckpt/new.safetensors" "$ckpt/../synthetic/x.safetensors"; do
  run checkpoint consolidate "$ckpt" "$out"
  expect_rc 1 "consolidate onto $out"
  expect_text "$work/err" "is inside the checkpoint $ckpt that it reads" "consolidate onto $out"
done
diff -r "$ckpt" "$work/synthetic.copy" >/dev/null || fail "consolidate into the checkpoint changed it"
run checkpoint inspect "$ckpt"
expect_rc 0 "the checkpoint after refused consolidations"

# --- consolidate onto special files, links, directories and names that are no file
mkfifo "$work/fifo"
run checkpoint consolidate "$ckpt" "$work/fifo"
expect_rc 1 "consolidate onto a FIFO"
expect_text "$work/err" "the output $work/fifo is a FIFO" "consolidate onto a FIFO"
[ -p "$work/fifo" ] || fail "consolidate onto a FIFO: it is no longer a FIFO"
if mknod "$work/null" c 1 3 2>/dev/null; then
  run checkpoint consolidate "$ckpt" "$work/null"
  expect_rc 1 "consolidate onto a device"
  expect_text "$work/err" "the output $work/null is a device" "consolidate onto a device"
  [ -c "$work/null" ] || fail "consolidate onto a device: it is no longer a device"
else
  echo "note: mknod not permitted here; the device-node case is checked through a link to /dev/null only"
fi
ln -s /dev/null "$work/link"
run checkpoint consolidate "$ckpt" "$work/link"
expect_rc 1 "consolidate onto a symbolic link"
expect_text "$work/err" "is a symbolic link" "consolidate onto a symbolic link"
[ -L "$work/link" ] || fail "consolidate onto a symbolic link: it is no longer a link"
run checkpoint consolidate "$ckpt" "$work/mine"
expect_rc 1 "consolidate onto a directory"
expect_text "$work/err" "is a directory" "consolidate onto a directory"
for out in "" "." ".." "$work/.." "$work/new/"; do
  rc=0  # run from inside a directory of the user's: '.' and '' name it
  (cd "$work/mine" && exec timeout 60 "$zest" checkpoint consolidate "$ckpt" "$out") >"$work/out" 2>"$work/err" </dev/null || rc=$?
  expect_rc 1 "consolidate onto '$out'"
  expect_text "$work/err" "names no file" "consolidate onto '$out'"
done
[ "$(ls "$work/mine")" = "notes.txt" ] || fail "consolidate onto '.'-like names left: $(ls "$work/mine")"
ls "$work" | grep -q '\.tmp-' && fail "refused consolidations left temporary files: $(ls "$work")"

# --- consolidate onto an existing file: refused unless zest wrote it
run checkpoint consolidate "$ckpt" "$work/model.pt"
expect_rc 1 "consolidate onto a user's file"
expect_text "$work/err" "exists and is not a safetensors file written by zest" "consolidate onto a user's file"
unchanged "$work/model.pt" "$work/model.copy" "consolidate onto a user's file"
run checkpoint consolidate "$ckpt" "$work/model.safetensors"
expect_rc 0 "consolidate to a new file"
run checkpoint consolidate "$ckpt" "$work/model.safetensors" --dtype bf16
expect_rc 0 "consolidate onto a file zest wrote"
[ "$(stat -c %s "$work/model.safetensors")" -lt 4400 ] || fail "consolidate onto a file zest wrote: not replaced by the bf16 one"

# --- a FIFO named manifest: refused, not waited on
cp -r "$work/synthetic.copy" "$work/fifo-ckpt"
rm "$work/fifo-ckpt/manifest"
mkfifo "$work/fifo-ckpt/manifest"
run checkpoint inspect "$work/fifo-ckpt"
expect_rc 2 "inspect with a FIFO manifest"
expect_text "$work/err" "manifest $work/fifo-ckpt/manifest is a FIFO, not a regular file" "inspect with a FIFO manifest"
run checkpoint consolidate "$work/fifo-ckpt" "$work/fifo.safetensors"
expect_rc 1 "consolidate with a FIFO manifest"
expect_text "$work/err" "is a FIFO, not a regular file" "consolidate with a FIFO manifest"
run_train --load "$work/fifo-ckpt"
expect_rc 1 "zest-train --load with a FIFO manifest"
expect_text "$work/err" "is a FIFO, not a regular file" "zest-train --load with a FIFO manifest"

# --- a checkpoint whose step count passes what an int holds (edited, checksum resealed): zest-train
# resumes after it and trains no more steps (it used to wrap to step -2^31 and train 2^31 steps)
run_train --save "$work/far"
expect_rc 0 "save for the step-count case"
sed -i 's/^steps .*/steps 2147483647/' "$work/far/manifest"
"$make_checkpoint" --reseal "$work/far/manifest"
run_train --load "$work/far"
expect_rc 0 "load a checkpoint at step 2^31-1"
expect_text "$work/out" "resumed from $work/far after step 2147483647" "load a checkpoint at step 2^31-1"
grep -q '^step ' "$work/out" && fail "load a checkpoint at step 2^31-1: it trained more steps"
# Out of range, though resealed: refused before training, naming the field.
sed -i 's/^stage .*/stage 9/' "$work/far/manifest"
"$make_checkpoint" --reseal "$work/far/manifest"
run_train --load "$work/far"
expect_rc 1 "load a checkpoint of stage 9"
expect_text "$work/err" "stage 9 is out of range (0 to 3)" "load a checkpoint of stage 9"

# --- consolidate past the file-size limit (ulimit -f): an error naming the output, no temporary
# file left behind (SIGXFSZ used to kill it mid-write, leaving OUT.tmp-<n>)
rc=0
(ulimit -f 1 && exec timeout 60 "$zest" checkpoint consolidate "$ckpt" "$work/limited.safetensors") \
  >"$work/out" 2>"$work/err" </dev/null || rc=$?
expect_rc 1 "consolidate past the file-size limit"
expect_text "$work/err" "consolidate: cannot write $work/limited.safetensors" "consolidate past the file-size limit"
for left in "$work"/limited.safetensors*; do
  [ -e "$left" ] && fail "consolidate past the file-size limit left $left behind"
done

[ "$failures" -eq 0 ] || exit 1
echo "checkpoint safety: all cases passed"
