#!/bin/sh
# zest estimate: the table (every configuration, exact figures for a model whose sizes are worked
# out by hand below), the per-node columns, --config and --dtype, and exit codes for bad input.
# $1: the zest binary. ZEST_TEST_DATA: the tests/ source directory (set by tests/meson.build).
set -eu

zest=${1:?usage: estimate_test.sh PATH_TO_ZEST}
data=${ZEST_TEST_DATA:?ZEST_TEST_DATA must name the tests/ source directory}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

. "$(dirname "$0")/expect.sh"

# figures NAME [FILE]: the figures of configuration NAME's row, single-spaced; each is a number
# and a unit: device/rank 1-2, params 3-4, grads 5-6, optim states 7-8, buffers 9-10,
# pinned host/node 11-12, NVMe/node 13-14.
figures() {
  awk -v name="$1" 'index($0, name) == 1 && substr($0, length(name) + 1) ~ /^ +[0-9]/ {
    print substr($0, length(name) + 1) }' "${2:-$work/out}" | sed 's/  */ /g; s/^ //'
}

expect_row() {
  got=$(figures "$1")
  [ "$got" = "$2" ] || fail "$3: row '$1' is '$got', expected '$2'"
}

# --- 1,000,000 fp32 parameters in one layer (a multiple of 64: no padding), 2 ranks on one node.
# Stage 0 per rank: params 4,000,000 B (3.8 MiB), grads the same, m+v 8,000,000 B (7.6 MiB: fp32
# parameters and states on the device, so the parameters are the master weights), buffers two
# gradient buckets of the layer + 24 B of step scalars = 8,000,024 B (7.6 MiB), total 24,000,024 B
# (22.9 MiB). Pinned per rank: 256 B of scalars + 1,000,000 fp32
# staging values = 4,000,256 B; two ranks per node: 8,000,512 B (7.6 MiB).
run estimate --params 1000000 --layers 1 --ranks-per-node 2 --dtype fp32
expect_rc 0 "small model"
[ ! -s "$work/err" ] || fail "small model: unexpected stderr: $(cat "$work/err")"
expect_text "$work/out" "zest estimate: 1.0M parameters (1000000) in 1 layers, fp32, fp32 optimizer states; 2 ranks per node x 1 node = 2 ranks" "small model"
expect_row "stage 0" "22.9 MiB 3.8 MiB 3.8 MiB 7.6 MiB 7.6 MiB 7.6 MiB 0 B" "small model"
# Stage 2 on 2 ranks: grads and optimizer states halve (2,000,000 B = 1.9 MiB; 4,000,000 B =
# 3.8 MiB): 18,000,024 B = 17.2 MiB.
expect_row "stage 2" "17.2 MiB 3.8 MiB 1.9 MiB 3.8 MiB 7.6 MiB 7.6 MiB 0 B" "small model"
# Stage 3: params halve too; one gathered buffer (never more than the layers) adds the layer's
# 4,000,000 B to the buffers (12,000,024 B = 11.4 MiB): 20,000,024 B = 19.1 MiB.
expect_row "stage 3" "19.1 MiB 1.9 MiB 1.9 MiB 3.8 MiB 11.4 MiB 7.6 MiB 0 B" "small model"
# Stage 3 with a secondary partition: half the layer (the 2 ranks of the node), 2,000,000 B more
# params: 22,000,024 B = 21.0 MiB.
expect_row "stage 3, secondary host" "21.0 MiB 3.8 MiB 1.9 MiB 3.8 MiB 11.4 MiB 7.6 MiB 0 B" "small model"
rows=$(grep -cE '^stage [0-3]' "$work/out")
[ "$rows" -eq 13 ] || fail "small model: $rows configuration rows, expected 13"
for name in "stage 1, optimizer cpu" "stage 1, optimizer nvme" "stage 2, optimizer nvme" \
            "stage 3, optimizer cpu" "stage 3, optimizer+params cpu" "stage 3, optimizer+params nvme"; do
  [ -n "$(figures "$name")" ] || fail "small model: no row '$name'"
done
# Offloaded optimizer states leave the device for pinned host memory, and so does the gradient
# shard (the device keeps its buckets). Per rank: the engine's 4,000,256 B, master+m+v of the
# 500,000-parameter shard (6,000,000 B), output staging of 4 sub-group slots (the shard is one
# sub-group: 2,000,000 B rounded to 256 = 2,000,128 B; 8,000,512 B), the gradient shard
# (2,000,000 B) and the landing buffer of one bucket's shard (the bucket holds the layer: 2,000,000
# B): 22,000,768 B; two ranks per node: 44,001,536 B = 42.0 MiB.
[ "$(figures "stage 2, optimizer cpu" | cut -d' ' -f5-8)" = "0 B 0 B" ] ||
  fail "stage 2 cpu: gradients or optimizer states on the device"
[ "$(figures "stage 2, optimizer cpu" | cut -d' ' -f11-12)" = "42.0 MiB" ] ||
  fail "stage 2 cpu: pinned/node '$(figures "stage 2, optimizer cpu" | cut -d' ' -f11-12)'"
[ "$(figures "stage 2, optimizer cpu" | cut -d' ' -f13-14)" = "0 B" ] || fail "stage 2 cpu: NVMe space"
# NVMe: the shard's 6,000,000 B of states rounded up to 4 KiB (6,000,640 B) per rank, two ranks.
[ "$(figures "stage 2, optimizer nvme" | cut -d' ' -f13-14)" = "11.4 MiB" ] ||
  fail "stage 2 nvme: NVMe/node '$(figures "stage 2, optimizer nvme" | cut -d' ' -f13-14)'"

# --- a partial offload (offload.optimizer.ratio 0.5): its own row, marked. The device keeps the
# states of the first half of each 500,000-element shard, rounded down to 64 elements: 249,984 x
# 12 B = 2,999,808 B (2.9 MiB), so 4,000,000 + 2,000,000 + 2,999,808 + 8,000,024 = 16,999,832 B
# (16.2 MiB) per device. Pinned per rank: the engine's 4,000,256 B, the other 250,016 parameters'
# states (3,000,192 B) and 2 x 4 staging slots of one sub-group (1,000,064 B rounded to 256 =
# 1,000,192 B): 15,001,984 B; two ranks per node: 30,003,968 B = 28.6 MiB.
printf 'stage: 2\noffload: {optimizer: {device: cpu, ratio: 0.5}}\n' > "$work/ratio.yaml"
run estimate --params 1000000 --layers 1 --ranks-per-node 2 --dtype fp32 --config "$work/ratio.yaml"
expect_rc 0 "ratio"
expect_row "stage 2, optimizer cpu ratio 0.5 *" "16.2 MiB 3.8 MiB 1.9 MiB 2.9 MiB 7.6 MiB 28.6 MiB 0 B" "ratio"
expect_row "stage 2, optimizer cpu" "11.4 MiB 3.8 MiB 0 B 0 B 7.6 MiB 42.0 MiB 0 B" "ratio"

# --- the step updated ahead during backward (offload.optimizer.update_ahead): its own row, marked.
# Each rank keeps a second region per sub-group (NVMe doubles: 4 x 6,000,640 B = 22.9 MiB per node)
# and pins its shard's updated fp32 parameters (500,000 x 4 B, rounded to 256: 2,000,128 B; two
# ranks: 4,000,256 B = 3.8 MiB more than the row without update_ahead).
printf 'stage: 2\noffload: {optimizer: {device: nvme, path: "%s", update_ahead: true}}\n' "$work" \
  > "$work/update_ahead.yaml"
run estimate --params 1000000 --layers 1 --ranks-per-node 2 --dtype fp32 --config "$work/update_ahead.yaml"
expect_rc 0 "update_ahead"
expect_row "stage 2, optimizer nvme update_ahead *" "11.4 MiB 3.8 MiB 0 B 0 B 7.6 MiB 80.1 MiB 22.9 MiB" "update_ahead"
expect_row "stage 2, optimizer nvme" "11.4 MiB 3.8 MiB 0 B 0 B 7.6 MiB 76.3 MiB 11.4 MiB" "update_ahead"

# --- per node: the same 4 ranks as 4 per node x 1 node and 2 per node x 2 nodes: device figures
# equal; pinned host per node (stage 1: 4 or 2 x 4,000,256 B) halves.
run estimate --params 1000000 --layers 1 --ranks-per-node 4 --nodes 1 --dtype fp32
expect_rc 0 "4x1"
cp "$work/out" "$work/out.4x1"
run estimate --params 1000000 --layers 1 --ranks-per-node 2 --nodes 2 --dtype fp32
expect_rc 0 "2x2"
expect_text "$work/out" "2 ranks per node x 2 nodes = 4 ranks" "2x2"
for name in "stage 0" "stage 1" "stage 2, optimizer cpu" "stage 3, optimizer+params nvme"; do
  [ "$(figures "$name" | cut -d' ' -f1-10)" = "$(figures "$name" "$work/out.4x1" | cut -d' ' -f1-10)" ] ||
    fail "per node: '$name' device figures differ between 4x1 and 2x2"
done
[ "$(figures "stage 1" "$work/out.4x1" | cut -d' ' -f11-12)" = "15.3 MiB" ] || fail "4x1: stage 1 pinned/node"
[ "$(figures "stage 1" | cut -d' ' -f11-12)" = "7.6 MiB" ] || fail "2x2: stage 1 pinned/node"

# --- counts as people write them
run estimate --params 1.5e9 --layers 30
expect_rc 0 "1.5e9"
expect_text "$work/out" "1.50B parameters (1500000000) in 30 layers, bf16" "1.5e9"
run estimate --params 7B
expect_rc 0 "7B"
expect_text "$work/out" "7.00B parameters (7000000000) in 32 layers, bf16, fp32 optimizer states; 1 rank per node x 1 node = 1 rank" "7B"

# --- a config file: its settings and dtype, its own row marked
run estimate --params 350M --config "$data/config/cases/full.yaml"
expect_rc 0 "config"
expect_text "$work/out" "in 32 layers, fp16" "config"
[ -n "$(grep -E '^stage 3, optimizer\+params cpu ratio 0\.5, secondary host \* ' "$work/out")" ] || fail "config: its row is not marked:
$(cat "$work/out")"
[ "$(grep -c ' \* ' "$work/out")" -eq 1 ] || fail "config: not exactly one row marked"
run estimate --params 350M --config "$data/config/cases/full.yaml" --dtype bf16
expect_text "$work/out" "in 32 layers, bf16, int8 optimizer states" "--dtype over the config, its states kept"
# --- optimizer.states: master, m and v of 7e9 parameters take 12, 8 or 6.125 bytes each
# (78.23, 52.15 and 39.93 GiB), --states over the config's
for states in "fp32 78.23" "bf16 52.15" "int8 39.93"; do
  set -- $states
  run estimate --params 7B --states "$1"
  expect_rc 0 "--states $1"
  [ -n "$(grep -E "^stage 1 +[0-9.]+ GiB +13.04 GiB +13.04 GiB +$2 GiB" "$work/out")" ] || fail "--states $1: stage 1's states are not $2 GiB:
$(cat "$work/out")"
done
run estimate --params 350M --config "$data/config/cases/full.yaml" --states bf16
expect_text "$work/out" "fp16, bf16 optimizer states" "--states over the config"
# A bf16 master: 2 + 2.125 bytes per parameter (7e9: 26.89 GiB); an override the engine would
# refuse (fp32 moments under a bf16 master) is refused, saying why.
run estimate --params 7B --config "$data/config/cases/bf16_master.yaml"
expect_rc 0 "bf16 master"
expect_text "$work/out" "int8 optimizer states with a bf16 master" "bf16 master"
[ -n "$(grep -E "^stage 1 +[0-9.]+ GiB +13.04 GiB +13.04 GiB +26.89 GiB" "$work/out")" ] || fail "bf16 master: stage 1's states are not 26.89 GiB:
$(cat "$work/out")"
run estimate --params 7B --config "$data/config/cases/bf16_master.yaml" --states fp32
expect_rc 2 "bf16 master with --states fp32"
expect_text "$work/err" "a bf16 master (optimizer.master in $data/config/cases/bf16_master.yaml) needs compact moments" "bf16 master with --states fp32"

# --- bad input: exit 2 with a message saying what is wrong
bad() {
  expected=$1
  shift
  run estimate "$@"
  expect_rc 2 "estimate $*"
  expect_text "$work/err" "$expected" "estimate $*"
  [ ! -s "$work/out" ] || fail "estimate $*: unexpected stdout"
}
bad "--params N is required"
bad "--params N is required" --layers 4
bad "--params: expected a whole count from 1 to 1000000000000000 (e.g. 4000000, 350M, 7B, 1.5e9), found 'abc'" --params abc
bad "--params: expected a whole count from 1 to 1000000000000000 (e.g. 4000000, 350M, 7B, 1.5e9), found '1.5': not a whole number" --params 1.5
bad "--params: expected a whole count" --params 7X
bad "--states: expected one of fp32, bf16, int8, found 'fp8'" --params 7B --states fp8
bad "--params: expected a whole count" --params -5
bad "--params: expected a whole count" --params nan
bad "--params: expected a whole count" --params 1e19
bad "--layers: expected a whole number from 1 to 100000, found '0'" --params 100 --layers 0
bad "--ranks-per-node: expected a whole number" --params 100 --ranks-per-node two
bad "--nodes: expected a whole number" --params 100 --nodes 0
bad "--dtype: expected bf16, fp16 or fp32, found 'fp8'" --params 100 --dtype fp8
bad "--params 3 is fewer than --layers 4" --params 3 --layers 4
bad "unknown option '--bogus'" --params 100 --bogus 1
bad "--nodes needs a value" --params 100 --nodes
bad "usage: zest estimate" --params

# --- wire bytes across nodes: ZeRO++'s three (hpZ, int8 parameters, int4 gradients) send at most
# 0.3x stage 3's bytes between nodes (100M fp32 parameters in 12 layers, 2 nodes x 2 ranks).
# bytes NAME: the row's "across nodes" figure in bytes (columns: total, inside, across, ...).
bytes() {
  awk -v name="$1" 'index($0, name) == 1 && substr($0, length(name) + 1) ~ /^ +[0-9]/ {
    split(substr($0, length(name) + 1), f, " ")
    m = f[6] == "B" ? 1 : f[6] == "KiB" ? 1024 : f[6] == "MiB" ? 1048576 : f[6] == "GiB" ? 1073741824 : -1
    printf "%.0f\n", f[5] * m }' "$work/out"
}
run estimate --params 100000000 --layers 12 --ranks-per-node 2 --nodes 2 --dtype fp32
expect_rc 0 "wire"
plain=$(bytes "wire, stage 3") zpp=$(bytes "wire, stage 3, secondary host, params int8, grads int4")
[ -n "$plain" ] && [ -n "$zpp" ] && [ "$plain" -gt 0 ] || fail "wire: no stage 3 rows ('$plain', '$zpp')"
[ $((zpp * 10)) -le $((plain * 3)) ] || fail "wire: hpZ+qwZ+qgZ send $zpp bytes across nodes, more than 0.3x stage 3's $plain"
[ -n "$(bytes "wire, stage 3, params int8, grads int4")" ] || fail "wire: no quantized stage 3 row"

run estimate --params 100 --config "$data/config/cases/out_of_range.yaml"
expect_rc 2 "invalid config"
expect_text "$work/err" "out_of_range.yaml:1:8: stage: expected an integer from 0 to 3, found '4'" "invalid config"

run estimate --help
expect_rc 0 "--help"
expect_text "$work/out" "usage: zest estimate --params N" "--help"

if [ "$failures" -ne 0 ]; then
  echo "$failures check(s) failed" >&2
  exit 1
fi
echo "estimate: all checks passed"
