#!/usr/bin/env bash
# zest across hosts: two simulated hosts (network namespaces on a bridge, 10.77.0.1 and
# 10.77.0.2, each with its own node-local directory), 2 ranks each, Open MPI over TCP between them
# (mpirun runs in a third namespace; its rsh agent reaches each host through `ip netns exec`). Checks:
#   - zest-train's loss curve at every stage (and stage 2 with NVMe offload) on 2 hosts x 2 ranks is
#     the same text as the same config on 4 ranks of one host;
#   - NVMe offload writes each host's own directory: host A's holds exactly ranks 0 and 1's swap
#     files, host B's ranks 2 and 3's, each the size the engine reports;
#   - a checkpoint saved by the 4 ranks across the hosts (on a path both see) loads on 2 ranks of one
#     host and continues on the uninterrupted loss curve (within 1e-5);
#   - per host, the pinned host memory and NVMe bytes the ranks measured match `zest estimate
#     --nodes 2 --ranks-per-node 2`'s per-node figures.
#   - Communicator::split_across_hosts gives each rank the ranks at its place on each host (0 and
#     2, 1 and 3), ranked by host.
# All traffic stays on the namespaces' addresses. Needs root and iproute2 (CI runs as root); exits
# 77 (skipped), saying why, where namespaces cannot be made. Every mpirun is bounded (60 s).
# usage: multihost_test.sh ZEST_TRAIN PROBE ZEST MPIRUN SOURCE_DIR
set -euo pipefail
train=$1 probe=$2 zest=$3 mpirun=$4 source=$5
# The hosts, their link, the rsh agent and the mpirun helpers (sim_two_hosts, sim_one_host), shared
# with bench/slow_link.sh.
# shellcheck source=SCRIPTDIR/../../scripts/sim-hosts.sh
source "$source/scripts/sim-hosts.sh"
sim_hosts_up "$mpirun"
work=$sim_work
# shared/ is the path both hosts see (checkpoints).
mkdir -p "$sim_host_a/swap" "$sim_host_b/swap" "$work/shared"

failures=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }

# config NAME STAGE [YAML]: writes NAME.yaml into both hosts' directories (an nvme path in YAML
# written @HOST@ becomes the host's own directory).
config() {
  local name=$1 stage=$2 extra=${3:-}
  { sed -e "s/^stage: .*/stage: $stage/" "$source/configs/train-tiny.yaml"; printf '%s\n' "$extra"; } |
    sim_hosts_write "$name.yaml"
}
# losses OUT: the "step loss" lines of a zest-train output
losses() { awk '$1 == "step" { print $2, $4 }' "$1"; }

# --- Every stage (and stage 2 with its optimizer states in each host's NVMe directory): the 2x2
# loss curve is the single-host 4-rank one, to the last printed digit.
steps=10
nvme=$(printf 'offload:\n  optimizer: {device: nvme, path: @HOST@/swap}')
hpz='partition: {secondary: host}'
for run in "stage0 0" "stage1 1" "stage2 2" "stage3 3" "stage2-nvme 2 nvme" "stage3-hpz 3 hpz"; do
  # shellcheck disable=SC2086  # split into NAME STAGE [nvme|hpz]
  set -- $run
  case ${3:-} in
    nvme) config "$1" "$2" "$nvme" ;;
    hpz) config "$1" "$2" "$hpz" ;;
    *) config "$1" "$2" ;;
  esac
  sim_two_hosts "$train" --config "@HOST@/$1.yaml" --steps "$steps" > "$work/$1.2x2.out" 2>&1 ||
    { fail "$1 on 2 hosts x 2 ranks"; cat "$work/$1.2x2.out"; continue; }
  sim_one_host "$sim_ns_a" "$sim_host_a" 4 "$train" --config "@HOST@/$1.yaml" --steps "$steps" > "$work/$1.1x4.out" 2>&1 ||
    { fail "$1 on 1 host x 4 ranks"; cat "$work/$1.1x4.out"; continue; }
  losses "$work/$1.2x2.out" > "$work/$1.2x2.loss"
  losses "$work/$1.1x4.out" > "$work/$1.1x4.loss"
  if [ "$(wc -l < "$work/$1.2x2.loss")" -ne "$steps" ]; then
    fail "$1: 2x2 printed no loss curve"; cat "$work/$1.2x2.out"
  elif ! cmp -s "$work/$1.2x2.loss" "$work/$1.1x4.loss"; then
    fail "$1: 2 hosts x 2 ranks differ from 1 host x 4 ranks"; diff "$work/$1.1x4.loss" "$work/$1.2x2.loss" || true
  fi
done
grep -q "4 rank(s)" "$work/stage0.2x2.out" || fail "the 2x2 run did not have 4 ranks"
grep -qx "$sim_ip_b" "$work/agent.log" || fail "host B's daemon was not started through the agent"

# --- Bytes on the wire split by host (Communicator::host_of from MPI): rank 0 sends the same in
# total on 2 hosts x 2 ranks as on 1 host x 4; on 2x2, at stages 1-3 every peer gets the same bytes
# and two of its three peers are on the other host, so across = 2 x inside (but for step()'s
# all-reduce of two floats, whose uneven blocks differ by 8 bytes); on one host none cross.
wire() {  # wire OUT: "total inside across" of zest-train's wire line
  sed -n 's/.*wire bytes per step[^:]*: \([0-9]*\) (inside its host \([0-9]*\), to other hosts \([0-9]*\);.*/\1 \2 \3/p' "$1"
}
for run in stage1 stage2 stage3; do
  read -r total inside across <<< "$(wire "$work/$run.2x2.out")"
  read -r total1 inside1 across1 <<< "$(wire "$work/$run.1x4.out")"
  if [ -z "${total:-}" ] || [ -z "${total1:-}" ]; then
    fail "$run: no wire bytes line"; continue
  fi
  [ "$total" = "$total1" ] || fail "$run: 2x2 sent $total bytes, 1x4 $total1"
  [ "$across1" = 0 ] || fail "$run: 1 host x 4 ranks sent $across1 bytes to other hosts"
  skew=$((across - 2 * inside))
  [ "$across" -gt 0 ] && [ "${skew#-}" -le 16 ] ||
    fail "$run: 2x2 sent $inside bytes inside the host and $across across (want twice as many across)"
done

# --- partition.secondary: host (hpZ): the same loss curve as plain stage 3 on the two hosts, with
# fewer bytes across them (backward's gathers stay inside each host).
cmp -s "$work/stage3-hpz.2x2.loss" "$work/stage3.2x2.loss" ||
  fail "partition.secondary: host changed stage 3's loss curve on 2 hosts x 2 ranks"
read -r _ _ plain_across <<< "$(wire "$work/stage3.2x2.out")"
read -r _ _ hpz_across <<< "$(wire "$work/stage3-hpz.2x2.out")"
[ -n "${hpz_across:-}" ] && [ "$hpz_across" -lt "${plain_across:-0}" ] ||
  fail "partition.secondary: host sent ${hpz_across:-?} bytes across hosts, plain stage 3 ${plain_across:-?}"

# --- ZeRO++'s three (hpZ, int8 parameter gathers, int4 gradient reduction through the hosts'
# all-to-alls): a loss curve near stage 3's (the last loss within 2%), at most 0.3x its bytes
# across the hosts, and reductions that run as all-to-alls inside and across them.
config stage3-zpp 3 "$(printf 'comm: {quantize: {params: int8, grads: int4}}\n%s' "$hpz")"
if sim_two_hosts "$train" --config "@HOST@/stage3-zpp.yaml" --steps "$steps" > "$work/stage3-zpp.2x2.out" 2>&1; then
  losses "$work/stage3-zpp.2x2.out" > "$work/stage3-zpp.2x2.loss"
  exact=$(tail -n 1 "$work/stage3.2x2.loss" | cut -d' ' -f2) quantized=$(tail -n 1 "$work/stage3-zpp.2x2.loss" | cut -d' ' -f2)
  [ "$(wc -l < "$work/stage3-zpp.2x2.loss")" -eq "$steps" ] &&
    awk -v q="$quantized" -v e="$exact" 'BEGIN { d = (q - e) / e; exit !(d < 0.02 && d > -0.02) }' ||
    fail "stage 3 with hpZ, qwZ and qgZ: last loss ${quantized:-?}, stage 3's ${exact:-?} (want within 2%)"
  cmp -s "$work/stage3-zpp.2x2.loss" "$work/stage3.2x2.loss" && fail "the quantized run's loss curve equals stage 3's"
  read -r _ zpp_inside zpp_across <<< "$(wire "$work/stage3-zpp.2x2.out")"
  echo "stage 3 with hpZ, qwZ, qgZ: last loss $quantized (stage 3: $exact); bytes across hosts ${zpp_across:-?} (stage 3: ${plain_across:-?})"
  [ -n "${zpp_across:-}" ] && [ "$((zpp_across * 10))" -le "$((${plain_across:-0} * 3))" ] && [ "${zpp_inside:-0}" -gt 0 ] ||
    fail "stage 3 with hpZ, qwZ and qgZ sent ${zpp_across:-?} bytes across hosts (${zpp_inside:-?} inside), plain stage 3 ${plain_across:-?}"
else
  fail "stage 3 with hpZ, qwZ and qgZ on 2 hosts x 2 ranks"; cat "$work/stage3-zpp.2x2.out"
fi

# --- A checkpoint saved by 4 ranks across the hosts (stage 3, to shared/) loads on 2 ranks of host
# B (stage 1) and continues on the uninterrupted curve (stage3.1x4 above).
config ckpt-save 3
config ckpt-load 1
sim_two_hosts "$train" --config "@HOST@/ckpt-save.yaml" --steps 5 --save "$work/shared/ckpt" > "$work/save.out" 2>&1 ||
  { fail "save on 2 hosts x 2 ranks"; cat "$work/save.out"; }
sim_one_host "$sim_ns_b" "$sim_host_b" 2 "$train" --config "@HOST@/ckpt-load.yaml" --load "$work/shared/ckpt" \
  --steps "$steps" > "$work/load.out" 2>&1 || { fail "load on 1 host x 2 ranks"; cat "$work/load.out"; }
grep -q "resumed from .* after step 5" "$work/load.out" || { fail "the 2-rank run did not resume after step 5"; cat "$work/load.out"; }
losses "$work/load.out" > "$work/load.loss"
[ "$(wc -l < "$work/load.loss")" -eq $((steps - 5)) ] || fail "the resumed run printed $(wc -l < "$work/load.loss") losses"
awk 'NR == FNR { want[$1] = $2; next }
  { d = $2 - want[$1]; if (d < 0) d = -d; r = d / (want[$1] > 1 ? want[$1] : 1)
    if (r > 1e-5) { printf "FAIL: resumed on one host, step %d: %s, uninterrupted %s\n", $1, $2, want[$1]; bad = 1 } }
  END { exit bad }' "$work/stage3.1x4.loss" "$work/load.loss" || failures=$((failures + 1))

# --- NVMe offload into node-local directories, and the per-node figures of zest estimate: the
# probe trains zest::uniform_model(PARAMS, LAYERS), the model `zest estimate` sizes, and lists
# each rank's offload directory while every engine is alive (swap files go with the engine).
params=3000000 layers=6
printf 'stage: 2\ndevice: {type: cpu, memory: 256MiB}\nbuckets: {reduce: 4MiB, allgather: 4MiB}\noffload:\n  optimizer: {device: nvme, path: @HOST@/swap}\n' |
  sim_hosts_write probe.yaml
sim_two_hosts "$probe" "@HOST@/probe.yaml" "$params" "$layers" 2 > "$work/probe.out" 2>&1 ||
  { fail "probe on 2 hosts x 2 ranks"; cat "$work/probe.out"; }
for rank in 0 1 2 3; do
  line=$(awk -v r="$rank" '$1 == "rank" && $2 == r' "$work/probe.out")
  [ -n "$line" ] || { fail "probe: no line for rank $rank"; cat "$work/probe.out"; continue; }
  # shellcheck disable=SC2086  # split into its fields:
  set -- $line  # rank R local L/S pinned P nvme N files LIST across A/N sum W
  host=$((rank / 2))
  first=$((host * 2))
  [ "$4" = "$((rank % 2))/2" ] || fail "rank $rank: local rank/size $4, expected $((rank % 2))/2"
  # Across hosts: the ranks at this rank's place on each host (r % 2 and r % 2 + 2), ranked by host.
  [ "${12}" = "$host/2" ] || fail "rank $rank: rank/size across hosts ${12}, expected $host/2"
  [ "${14}" = "$((2 * (rank % 2) + 2))" ] || fail "rank $rank: across hosts with world ranks summing to ${14}, expected $((2 * (rank % 2) + 2))"
  [ "$8" -gt 0 ] || fail "rank $rank: no NVMe bytes"
  # Every rank sizes its swap file alike (uniform layers, equal shards); both ranks of the host.
  want="zest-rank$first.swap:$8,zest-rank$((first + 1)).swap:$8"
  [ "${10}" = "$want" ] || fail "rank $rank (host $host): its directory holds '${10}', expected '$want'"
done
readable() { awk '{ b = $1; if (b < 1024) { print b " B"; exit } u = -1; split("KiB MiB GiB TiB", n, " ")
                    while (b >= 1024 && u < 3) { b /= 1024; u++ } printf(u >= 2 ? "%.2f %s\n" : "%.1f %s\n", b, n[u + 1]) }'; }
"$zest" estimate --params "$params" --layers "$layers" --nodes 2 --ranks-per-node 2 --config "$sim_host_a/probe.yaml" \
  > "$work/estimate.out" 2>&1 || { fail "zest estimate"; cat "$work/estimate.out"; }
# The config's own row is marked *; figures 11-12 are pinned host memory per node, 13-14 NVMe.
row=$(grep '^stage 2, optimizer nvme' "$work/estimate.out" | sed 's/^stage 2, optimizer nvme//; s/\*//g; s/  */ /g; s/^ //')
est_pinned=$(echo "$row" | cut -d' ' -f11-12) est_nvme=$(echo "$row" | cut -d' ' -f13-14)
for host in 0 1; do
  got_pinned=$(awk -v h="$host" '$1 == "rank" && int($2 / 2) == h { s += $6 } END { print s }' "$work/probe.out" | readable)
  got_nvme=$(awk -v h="$host" '$1 == "rank" && int($2 / 2) == h { s += $8 } END { print s }' "$work/probe.out" | readable)
  [ "$got_pinned" = "$est_pinned" ] || fail "host $host: pinned host memory $got_pinned, zest estimate says $est_pinned per node"
  [ "$got_nvme" = "$est_nvme" ] || fail "host $host: NVMe $got_nvme, zest estimate says $est_nvme per node"
done

if [ "$failures" -eq 0 ]; then
  echo "zest across 2 hosts x 2 ranks: stages 0-3 and NVMe offload equal the single-host run; swap files in each host's own directory;"
  echo "a checkpoint saved across the hosts resumed on 2 ranks of one; per node pinned $est_pinned and NVMe $est_nvme, as zest estimate says"
fi
exit "$failures"
