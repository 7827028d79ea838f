#!/usr/bin/env bash
# zest-train on 2 hosts x 2 ranks over a slow link between the hosts: seconds per step and the
# bytes that cross the link per step, per config, so that a mode which sends fewer bytes between
# hosts (issue 25) can be measured against the plain stages.
#
#   bench/slow_link.sh BUILD_DIR [--rate 1gbit[,none...]] [--steps N] [--repeats R] [--base FILE]
#                      [--timeout S] [--mpirun PATH] [--configs SPEC...]
#
# The hosts are scripts/sim-hosts.sh's (network namespaces on a bridge, Open MPI over TCP); the
# link between them is limited to --rate (default 1gbit; tc's units; `none` leaves it at the
# veth's speed, over 10 Gbit/s) in each direction, with a token bucket. Several rates, comma
# separated, are measured in the same run. Ranks of one host talk over its loopback, which is not
# limited. There is no added latency: this kernel has no netem (see sim_hosts_limit).
#
# Each SPEC is one config, run on the model of --base (default configs/train-slow-link.yaml):
#   stage2, stage3          the base at that stage (the default: stage3 stage2)
#   NAME=YAML               the base with YAML's top-level keys set, each replacing the base's
#                           whole section of that key; `;` separates keys, e.g.
#                           'stage3-host=stage: 3; partition: {secondary: host}'
#                           'stage3-int8=stage: 3; comm: {quantize: {params: int8}}'
#                           (@HOST@ in YAML is each host's own directory, e.g. an nvme path)
#
# Per rate, config and repeat, zest-train runs twice, --steps W and --steps W+N (W = 3 warm-up
# steps; N = --steps, default 20), and the difference of its "N steps in S s" and of the link's byte
# counters over the N extra steps gives one figure free of start-up and the first steps (stage 3
# records its gathering order in the first). Repeats are interleaved (A B A B ..., each rate in
# turn), so slow drift of a shared machine lands on every config alike. Prints a markdown table:
# per rate and config the median seconds per step and the spread (min-max) over the repeats; the
# link's floor, the busier host's sent bytes per step at the rate (the time the wire alone takes
# if nothing else did); the bytes the hosts sent each other per step (their veths' tx counters: a
# measurement, not a model), also as a multiple of the fp32 model, and over their loopbacks; and
# the line "zest-train: wire bytes per step ..." where zest-train prints one.
#
# Needs root (network namespaces; exits 77 saying why otherwise), iproute2 and tc. Every mpirun is
# bounded (--timeout, default 120 s); namespaces are removed on exit, interrupted or not.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
usage="usage: bench/slow_link.sh BUILD_DIR [--rate 1gbit[,none...]] [--steps N] [--repeats R] [--base FILE] [--timeout S] [--mpirun PATH] [--configs SPEC...]"
die() { echo "slow_link: $*" >&2; echo "$usage" >&2; exit 2; }

[ $# -ge 1 ] || die "BUILD_DIR is required"
case $1 in -h | --help) echo "$usage"; exit 0 ;; esac
build=$1
shift
rate=1gbit steps=20 repeats=5 base=$root/configs/train-slow-link.yaml warmup=3 sim_timeout=120
specs=()
while [ $# -gt 0 ]; do
  case $1 in
    --rate) rate=${2:?}; shift 2 ;;
    --steps) steps=${2:?}; shift 2 ;;
    --repeats) repeats=${2:?}; shift 2 ;;
    --base) base=${2:?}; shift 2 ;;
    --timeout) sim_timeout=${2:?}; shift 2 ;;
    --mpirun) mpirun=${2:?}; shift 2 ;;
    --configs) shift; specs+=("$@"); break ;;
    *) die "unexpected argument '$1'" ;;
  esac
done
[ ${#specs[@]} -gt 0 ] || specs=(stage3 stage2)
[[ $steps =~ ^[1-9][0-9]*$ ]] || die "--steps takes a positive whole number, not '$steps'"
[[ $repeats =~ ^[1-9][0-9]*$ ]] || die "--repeats takes a positive whole number, not '$repeats'"
[[ $sim_timeout =~ ^[1-9][0-9]*$ ]] || die "--timeout takes a positive whole number of seconds, not '$sim_timeout'"
train=$build/examples/zest-train
[ -x "$train" ] || die "no $train: build it first (ninja -C $build examples/zest-train)"
[ -f "$base" ] || die "no base config $base"
[ -n "${mpirun:-}" ] || mpirun=$(command -v mpirun || true)
[ -n "$mpirun" ] || die "no mpirun on PATH (give --mpirun PATH)"

# shellcheck source=scripts/sim-hosts.sh
source "$root/scripts/sim-hosts.sh"
IFS=, read -ra rates <<< "$rate"
for r in "${rates[@]}"; do
  [ "$r" = none ] || sim_rate_bits "$r" > /dev/null || die "--rate: '$r' is not a rate"
done
# Only root gets this far past sim_hosts_up, and Open MPI refuses root without these.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# Ranks waiting in MPI yield the core instead of busy-polling, as in the tests (tests/meson.build):
# both simulated hosts share this machine's cores, and polling ranks starve the ones with work.
# Real hosts with a core per rank would poll; set OMPI_MCA_mpi_yield_when_idle=0 to compare.
export OMPI_MCA_mpi_yield_when_idle=${OMPI_MCA_mpi_yield_when_idle:-1}
sim_hosts_up "$mpirun"
work=$sim_work

# write_config NAME SPEC: NAME.yaml in both hosts' directories.
write_config() {
  local name=$1 spec=$2 yaml="" key keys=()
  case $spec in
    stage[0-3]) yaml="stage: ${spec#stage}" ;;
    *=*) yaml=${spec#*=} ;;
    *) die "config '$spec' is neither stage0..stage3 nor NAME=YAML" ;;
  esac
  yaml=$(tr ';' '\n' <<< "$yaml" | sed 's/^ *//')  # one top-level key a line
  # The snippet's top-level keys replace the base's sections of the same name (a YAML mapping may
  # not hold a key twice): drop each such key's line and its indented (or blank/comment) lines.
  while IFS= read -r key; do keys+=("$key"); done < <(sed -n 's/^\([A-Za-z_][A-Za-z0-9_]*\):.*/\1/p' <<< "$yaml")
  { awk -v drop="${keys[*]:-}" '
      BEGIN { n = split(drop, k, " "); for (i = 1; i <= n; i++) skip[k[i]] = 1 }
      /^[^ \t]/ { dropping = 0 }  # a top-level line (a key or a comment) ends the section
      /^[A-Za-z_][A-Za-z0-9_]*:/ { key = $0; sub(/:.*/, "", key); dropping = (key in skip) }
      !dropping' "$base"
    printf '%s\n' "$yaml"; } | sim_hosts_write "$name.yaml"
}

# run NAME STEPS: one run of zest-train on 2 hosts x 2 ranks; sets run_s (its "steps in"
# seconds), run_a, run_b (the bytes hosts A and B sent on the link meanwhile) and run_lo (on the
# hosts' loopbacks).
run() {
  local name=$1 n=$2 a b lo out=$work/$1.$2.out
  a=$(sim_tx_bytes "$sim_ns_a" "$sim_veth_a") b=$(sim_tx_bytes "$sim_ns_b" "$sim_veth_b") lo=$(sim_loopback_tx_bytes)
  if ! sim_two_hosts "$train" --config "@HOST@/$name.yaml" --steps "$n" > "$out" 2>&1; then
    echo "slow_link: $name, $n steps failed (or ran past ${sim_timeout} s):" >&2
    cat "$out" >&2
    exit 1
  fi
  run_s=$(awk '/^zest-train: [0-9]+ steps in/ { print $5 }' "$out")
  [ -n "$run_s" ] || { echo "slow_link: $name, $n steps: no 'steps in' line" >&2; cat "$out" >&2; exit 1; }
  run_a=$(($(sim_tx_bytes "$sim_ns_a" "$sim_veth_a") - a)) run_b=$(($(sim_tx_bytes "$sim_ns_b" "$sim_veth_b") - b))
  run_lo=$(($(sim_loopback_tx_bytes) - lo))
}

names=()
for spec in "${specs[@]}"; do
  name=${spec%%=*}
  [[ $name =~ ^[A-Za-z0-9._-]+$ ]] || die "config name '$name' is not a file name"
  write_config "$name" "$spec"
  names+=("$name")
done

echo "slow_link: link $rate, ${#names[@]} config(s), $repeats repeats of $warmup and $((warmup + steps)) steps each" >&2
# samples: RATE NAME then, for the short and the long run, seconds, A's bytes, B's bytes, loopback bytes.
for ((r = 1; r <= repeats; r++)); do
  for link in "${rates[@]}"; do
    sim_hosts_limit "$link"
    for name in "${names[@]}"; do
      run "$name" "$warmup"
      short="$run_s $run_a $run_b $run_lo"
      run "$name" $((warmup + steps))
      echo "$link $name $short $run_s $run_a $run_b $run_lo" >> "$work/samples"
      echo "  repeat $r, link $link, $name: $warmup steps in ${short%% *} s, $((warmup + steps)) in $run_s s" >&2
    done
  done
done

params=$(awk '/^zest-train: [0-9]+ parameters/ { print $2; exit }' "$work/${names[0]}.$((warmup + steps)).out")
echo
echo "zest-train, $params parameters ($(basename "$base")), 2 hosts x 2 ranks; link each way: ${rate//,/, };"
echo "$steps steps after $warmup, $repeats repeats interleaved; mpi_yield_when_idle $OMPI_MCA_mpi_yield_when_idle;"
echo "$(nproc) cpus, load average at the end $(cut -d' ' -f1-3 /proc/loadavg)"
echo
echo "| link | config | s/step (median) | spread (min-max) | link floor, s/step | between hosts, MiB/step | x fp32 model | within hosts (loopback), MiB/step | zest-train says |"
echo "|---|---|---|---|---|---|---|---|---|"
for link in "${rates[@]}"; do
  bits=0
  [ "$link" = none ] || bits=$(sim_rate_bits "$link")
  for name in "${names[@]}"; do
    says=$(sed -n 's/^zest-train: wire bytes per step//p' "$work/$name.$((warmup + steps)).out" | head -1)
    awk -v link="$link" -v name="$name" -v n="$steps" -v params="$params" -v bits="$bits" -v says="${says:-—}" '
      function median(a, k,   i, j, x, s) {
        for (i = 1; i <= k; i++) s[i] = a[i]
        for (i = 2; i <= k; i++) { x = s[i]; for (j = i - 1; j >= 1 && s[j] > x; j--) s[j + 1] = s[j]; s[j + 1] = x }
        return k % 2 ? s[(k + 1) / 2] : (s[k / 2] + s[k / 2 + 1]) / 2
      }
      $1 == link && $2 == name {
        k++; t[k] = ($7 - $3) / n; a = ($8 - $4) / n; b = ($9 - $5) / n
        both[k] = a + b; busier[k] = a > b ? a : b; lo[k] = ($10 - $6) / n
      }
      END {
        least = most = t[1]; for (i = 2; i <= k; i++) { if (t[i] < least) least = t[i]; if (t[i] > most) most = t[i] }
        floor = bits > 0 ? sprintf("%.3f", median(busier, k) * 8 / bits) : "—"
        printf "| %s | %s | %.3f | %.3f-%.3f | %s | %.1f | %.2f | %.1f | %s |\n", link, name, median(t, k), least, most, floor,
               median(both, k) / 1048576, median(both, k) / (4 * params), median(lo, k) / 1048576, says
      }' "$work/samples"
  done
done
