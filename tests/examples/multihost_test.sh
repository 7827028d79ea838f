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
# All traffic stays on the namespaces' addresses. Needs root and iproute2 (CI runs as root); exits
# 77 (skipped), saying why, where namespaces cannot be made. Every mpirun is bounded (60 s).
# Each host has its own temporary directory (TMPDIR), as real hosts have their own /tmp: Open MPI
# keeps its session directory there, named after the hostname, which the simulated hosts share.
# With one /tmp, both hosts' daemons of a job wrote the same topology file (jf.N/hwloc.sm) at once,
# and one of them sometimes crashed before checking in (hwloc_shmem_topology_write), leaving mpirun
# waiting for it: the hang this test once had in about a third of its runs.
# usage: multihost_test.sh ZEST_TRAIN PROBE ZEST MPIRUN SOURCE_DIR
set -euo pipefail
train=$1 probe=$2 zest=$3 mpirun=$4 source=$5

skip() { echo "SKIP: $*"; exit 77; }
[ "$(id -u)" = 0 ] || skip "simulated hosts are network namespaces, which need root (CI runs as root)"
command -v ip > /dev/null || skip "no 'ip' command (iproute2) to make network namespaces"

work=$(mktemp -d)
# Hosts A and B, and L where mpirun runs (the launcher, with no ranks): A and B hang off a bridge
# in L by a veth pair each. mpirun on a host of its own ranks hangs in their first MPI_Comm_dup
# (its local ranks and a remote daemon share a hostname), so every host's daemon is started alike.
ns_a=zest-mh-a-$$ ns_b=zest-mh-b-$$ ns_l=zest-mh-l-$$
ip_a=10.77.0.1 ip_b=10.77.0.2 ip_l=10.77.0.3 subnet=10.77.0.0/24
cleanup() {
  for ns in "$ns_a" "$ns_b" "$ns_l"; do ip netns del "$ns" 2> /dev/null || true; done
  rm -rf "$work"
}
trap cleanup EXIT
trap "exit 143" TERM INT HUP  # a timeout (meson's SIGTERM) still removes the namespaces, once the
                              # running mpirun (at most 60 s) returns
if ! ip netns add "$ns_l" 2> "$work/netns.err"; then
  skip "cannot create a network namespace: $(cat "$work/netns.err")"
fi
ip netns add "$ns_a"
ip netns add "$ns_b"
for ns in "$ns_a" "$ns_b" "$ns_l"; do ip -n "$ns" link set lo up; done
ip -n "$ns_l" link add zbr type bridge
ip -n "$ns_l" addr add "$ip_l/24" dev zbr
ip -n "$ns_l" link set zbr up
for host in a b; do  # interface names: at most 15 characters
  ns=zest-mh-$host-$$ ip=$ip_a
  [ "$host" = b ] && ip=$ip_b
  ip link add "zmh$host$$" type veth peer name "zml$host$$"
  ip link set "zmh$host$$" netns "$ns"
  ip link set "zml$host$$" netns "$ns_l"
  ip -n "$ns_l" link set "zml$host$$" master zbr
  ip -n "$ns_l" link set "zml$host$$" up
  ip -n "$ns" addr add "$ip/24" dev "zmh$host$$"
  ip -n "$ns" link set "zmh$host$$" up
done

# Node-local directories: each host's ranks see theirs as $ZEST_TEST_HOST_DIR; shared/ is the path
# both hosts see (checkpoints).
mkdir -p "$work/hostA/swap" "$work/hostB/swap" "$work/hostA/tmp" "$work/hostB/tmp" "$work/shared"

# The rsh agent: "HOST COMMAND..." runs COMMAND on HOST, i.e. in its namespace, with its directory.
cat > "$work/agent" << AGENT
#!/bin/sh
host=\$1
shift
case \$host in
  $ip_a) ns=$ns_a dir=$work/hostA ;;
  $ip_b) ns=$ns_b dir=$work/hostB ;;
  *) echo "agent: unknown host \$host" >&2; exit 1 ;;
esac
echo "\$host" >> "$work/agent.log"
exec ip netns exec "\$ns" env ZEST_TEST_HOST_DIR="\$dir" TMPDIR="\$dir/tmp" sh -c "\$*"
AGENT
# on-host PROGRAM ARGS...: runs PROGRAM with each argument @HOST@/x replaced by $ZEST_TEST_HOST_DIR/x.
cat > "$work/on-host" << 'ONHOST'
#!/bin/sh
for arg; do
  shift
  case $arg in @HOST@*) arg=$ZEST_TEST_HOST_DIR${arg#@HOST@} ;; esac
  set -- "$@" "$arg"
done
exec "$@"
ONHOST
chmod +x "$work/agent" "$work/on-host"
printf '%s slots=2\n%s slots=2\n' "$ip_a" "$ip_b" > "$work/hostfile"

mpi_args=(--bind-to none --mca plm_rsh_agent "$work/agent" --mca plm_rsh_no_tree_spawn 1 --mca pml ob1 --mca btl_tcp_disable_family 6
          --mca btl_tcp_if_include "$subnet" --mca oob_tcp_if_include "$subnet")
# two_hosts PROGRAM ARGS...: 2 hosts x 2 ranks, mpirun on L. The ranks talk over TCP only:
# the simulated hosts share one kernel and hostname, so Open MPI's shared-memory segments
# (/dev/shm/vader_segment.HOST.JOB.LOCALRANK) of the two hosts' local rank 0 would be one file.
two_hosts() {
  timeout 60 ip netns exec "$ns_l" \
    "$mpirun" "${mpi_args[@]}" --mca btl tcp,self --hostfile "$work/hostfile" -np 4 "$work/on-host" "$@"
}
# one_host NS DIR RANKS PROGRAM ARGS...: RANKS ranks on one host (shared memory between them).
one_host() {
  local ns=$1 dir=$2 ranks=$3 host=$ip_a
  shift 3
  [ "$ns" = "$ns_b" ] && host=$ip_b
  timeout 60 ip netns exec "$ns" env ZEST_TEST_HOST_DIR="$dir" TMPDIR="$dir/tmp" \
    "$mpirun" "${mpi_args[@]}" --mca btl vader,self --oversubscribe --host "$host:$ranks" -np "$ranks" \
    "$work/on-host" "$@"
}

failures=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }

# config NAME STAGE [YAML]: writes NAME.yaml into both hosts' directories (an nvme path in YAML
# written @HOST@ becomes the host's own directory).
config() {
  local name=$1 stage=$2 extra=${3:-}
  for host in hostA hostB; do
    { sed -e "s/^stage: .*/stage: $stage/" "$source/configs/train-tiny.yaml"
      printf '%s\n' "${extra//@HOST@/$work/$host}"; } > "$work/$host/$name.yaml"
  done
}
# losses OUT: the "step loss" lines of a zest-train output
losses() { awk '$1 == "step" { print $2, $4 }' "$1"; }

# --- Every stage (and stage 2 with its optimizer states in each host's NVMe directory): the 2x2
# loss curve is the single-host 4-rank one, to the last printed digit.
steps=10
nvme=$(printf 'offload:\n  optimizer: {device: nvme, path: @HOST@/swap}')
for run in "stage0 0" "stage1 1" "stage2 2" "stage3 3" "stage2-nvme 2 nvme"; do
  set -- $run
  config "$1" "$2" "$([ "${3:-}" = nvme ] && printf '%s' "$nvme")"
  two_hosts "$train" --config "@HOST@/$1.yaml" --steps "$steps" > "$work/$1.2x2.out" 2>&1 ||
    { fail "$1 on 2 hosts x 2 ranks"; cat "$work/$1.2x2.out"; continue; }
  one_host "$ns_a" "$work/hostA" 4 "$train" --config "@HOST@/$1.yaml" --steps "$steps" > "$work/$1.1x4.out" 2>&1 ||
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
grep -qx "$ip_b" "$work/agent.log" || fail "host B's daemon was not started through the agent"

# --- A checkpoint saved by 4 ranks across the hosts (stage 3, to shared/) loads on 2 ranks of host
# B (stage 1) and continues on the uninterrupted curve (stage3.1x4 above).
config ckpt-save 3
config ckpt-load 1
two_hosts "$train" --config "@HOST@/ckpt-save.yaml" --steps 5 --save "$work/shared/ckpt" > "$work/save.out" 2>&1 ||
  { fail "save on 2 hosts x 2 ranks"; cat "$work/save.out"; }
one_host "$ns_b" "$work/hostB" 2 "$train" --config "@HOST@/ckpt-load.yaml" --load "$work/shared/ckpt" \
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
for host in hostA hostB; do
  printf 'stage: 2\ndevice: {type: cpu, memory: 256MiB}\nbuckets: {reduce: 4MiB, allgather: 4MiB}\noffload:\n  optimizer: {device: nvme, path: %s}\n' \
    "$work/$host/swap" > "$work/$host/probe.yaml"
done
two_hosts "$probe" "@HOST@/probe.yaml" "$params" "$layers" 2 > "$work/probe.out" 2>&1 ||
  { fail "probe on 2 hosts x 2 ranks"; cat "$work/probe.out"; }
for rank in 0 1 2 3; do
  line=$(awk -v r="$rank" '$1 == "rank" && $2 == r' "$work/probe.out")
  [ -n "$line" ] || { fail "probe: no line for rank $rank"; cat "$work/probe.out"; continue; }
  set -- $line  # rank R local L/S pinned P nvme N files LIST
  host=$((rank / 2))
  first=$((host * 2))
  [ "$4" = "$((rank % 2))/2" ] || fail "rank $rank: local rank/size $4, expected $((rank % 2))/2"
  [ "$8" -gt 0 ] || fail "rank $rank: no NVMe bytes"
  # Every rank sizes its swap file alike (uniform layers, equal shards); both ranks of the host.
  want="zest-rank$first.swap:$8,zest-rank$((first + 1)).swap:$8"
  [ "${10}" = "$want" ] || fail "rank $rank (host $host): its directory holds '${10}', expected '$want'"
done
readable() { awk '{ b = $1; if (b < 1024) { print b " B"; exit } u = -1; split("KiB MiB GiB TiB", n, " ")
                    while (b >= 1024 && u < 3) { b /= 1024; u++ } printf(u >= 2 ? "%.2f %s\n" : "%.1f %s\n", b, n[u + 1]) }'; }
"$zest" estimate --params "$params" --layers "$layers" --nodes 2 --ranks-per-node 2 --config "$work/hostA/probe.yaml" \
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
