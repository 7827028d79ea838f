#!/usr/bin/env bash
# What the quantized collectives (comm.quantize) cost in training quality: zest-gpt trained on two
# simulated hosts x 2 ranks (scripts/sim-hosts.sh), at stage 3 exactly and with each quantized
# mode, from the same seed on the same batches; prints each run's final loss (the mean of the last
# --window steps' losses, which a single step's noise would swamp) and its difference from the
# exact run's.
#
#   bench/quantized_quality.sh BUILD_DIR [--steps N] [--window W] [--timeout S] [--mpirun PATH]
#
# The model is configs/gpt-tiny.yaml made larger (4 blocks of width 64: 211,840 parameters, global
# batch 32, stage3.max_live 1MiB), trained --steps steps (default 400) with the learning rate
# halved every steps/4. Needs root (network
# namespaces; exits 77 saying why otherwise) and iproute2, as bench/slow_link.sh.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
usage="usage: bench/quantized_quality.sh BUILD_DIR [--steps N] [--window W] [--timeout S] [--mpirun PATH]"
die() { echo "quantized_quality: $*" >&2; echo "$usage" >&2; exit 2; }

[ $# -ge 1 ] || die "BUILD_DIR is required"
case $1 in -h | --help) echo "$usage"; exit 0 ;; esac
build=$1
shift
steps=400 window=50 sim_timeout=1200
while [ $# -gt 0 ]; do
  case $1 in
    --steps) steps=${2:?}; shift 2 ;;
    --window) window=${2:?}; shift 2 ;;
    --timeout) sim_timeout=${2:?}; shift 2 ;;
    --mpirun) mpirun=${2:?}; shift 2 ;;
    *) die "unexpected argument '$1'" ;;
  esac
done
[[ $steps =~ ^[1-9][0-9]*$ ]] || die "--steps takes a positive whole number, not '$steps'"
[[ $window =~ ^[1-9][0-9]*$ ]] && [ "$window" -le "$steps" ] || die "--window takes a whole number from 1 to --steps, not '$window'"
[[ $sim_timeout =~ ^[1-9][0-9]*$ ]] || die "--timeout takes a positive whole number of seconds, not '$sim_timeout'"
gpt=$build/examples/zest-gpt
[ -x "$gpt" ] || die "no $gpt: build it first (ninja -C $build examples/zest-gpt)"
[ -n "${mpirun:-}" ] || mpirun=$(command -v mpirun || true)
[ -n "$mpirun" ] || die "no mpirun on PATH (give --mpirun PATH)"

# shellcheck source=scripts/sim-hosts.sh
source "$root/scripts/sim-hosts.sh"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_mpi_yield_when_idle=${OMPI_MCA_mpi_yield_when_idle:-1}
sim_hosts_up "$mpirun"

# NAME and the comm section of each run; the first is the exact one the others are held to.
runs=(
  "exact|comm: {}"
  "params-int8|comm: {quantize: {params: int8}}"
  "grads-int8|comm: {quantize: {grads: int8}}"
  "grads-int4|comm: {quantize: {grads: int4}}"
  "params-int8+grads-int4|comm: {quantize: {params: int8, grads: int4}}"
  "hpz+params-int8+grads-int4|comm: {quantize: {params: int8, grads: int4}}
partition: {secondary: host}"
)
step_size=$((steps / 4 > 0 ? steps / 4 : 1))
echo "quantized_quality: zest-gpt, 2 hosts x 2 ranks, $steps steps, final loss over the last $window" >&2
results=()
for run in "${runs[@]}"; do
  name=${run%%|*} extra=${run#*|}
  # gpt-tiny with wider, deeper blocks and a slower schedule; `extra` sets comm (and partition).
  { sed -e 's/^  embed: 32$/  embed: 64/' -e 's/^  layers: 2$/  layers: 4/' -e 's/^  max_live: 256KiB .*/  max_live: 1MiB/' \
        -e "s/^  lr_step_size: 8 .*/  lr_step_size: $step_size/" -e 's/^  global_batch: 16 .*/  global_batch: 32/' \
        "$root/configs/gpt-tiny.yaml"
    printf '%s\n' "$extra"; } | sim_hosts_write "$name.yaml"
  out=$sim_work/$name.out
  start=$(date +%s.%N)
  if ! sim_two_hosts "$gpt" --config "@HOST@/$name.yaml" --steps "$steps" > "$out" 2>&1; then
    echo "quantized_quality: $name failed (or ran past ${sim_timeout} s):" >&2
    cat "$out" >&2
    exit 1
  fi
  seconds=$(echo "$(date +%s.%N) - $start" | bc)
  loss=$(awk -v w="$window" -v n="$steps" '$1 == "step" && $2 > n - w { s += $4; c++ } END { if (c) printf "%.5f", s / c }' "$out")
  [ -n "$loss" ] || { echo "quantized_quality: $name printed no step losses" >&2; cat "$out" >&2; exit 1; }
  results+=("$name $loss $seconds")
  echo "  $name: final loss $loss ($(printf '%.0f' "$seconds") s)" >&2
done

exact=$(awk '{ print $2 }' <<< "${results[0]}")
echo
echo "zest-gpt (configs/gpt-tiny.yaml with embed 64, 4 layers, global batch 32, max_live 1MiB), stage 3, 2 hosts x 2 ranks,"
echo "$steps steps (lr halved every $step_size); final loss = mean of the last $window steps' losses"
echo
echo "| run | final loss | vs exact | seconds |"
echo "|---|---:|---:|---:|"
for r in "${results[@]}"; do
  read -r name loss seconds <<< "$r"
  awk -v n="$name" -v l="$loss" -v e="$exact" -v s="$seconds" \
    'BEGIN { printf "| %s | %.4f | %+.2f%% | %.0f |\n", n, l, 100 * (l - e) / e, s }'
done
