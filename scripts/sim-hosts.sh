# shellcheck shell=bash
# Two simulated hosts on one machine, for a test or a benchmark that needs ranks on two hosts:
# network namespaces A (10.77.0.1) and B (10.77.0.2), each with its own node-local directory, hang
# off a bridge in a third namespace L (10.77.0.3, the launcher: mpirun runs there, with no ranks)
# by a veth pair each. Open MPI runs over TCP between them; its rsh agent reaches each host through
# `ip netns exec`. Sourced, not run:
#
#   source scripts/sim-hosts.sh
#   sim_hosts_up MPIRUN        # namespaces, link, directories, agent; traps that take them down
#   sim_hosts_limit 1gbit      # optional: rate-limit the link between the hosts (none: unlimit)
#   sim_hosts_write NAME < FILE   # FILE into both hosts' directories (@HOST@ -> the host's own)
#   sim_two_hosts PROGRAM ARGS...          # 2 hosts x 2 ranks
#   sim_one_host "$sim_ns_a" "$sim_host_a" 4 PROGRAM ARGS...   # 4 ranks on host A
#   sim_link_tx_bytes          # bytes the hosts have sent on the link so far
#   sim_loopback_tx_bytes      # ... on their loopbacks (ranks of one host to each other)
#   sim_tx_bytes NS DEV        # one interface's sent bytes
#
# Where it cannot make namespaces (not root, no iproute2, no permission) sim_hosts_up prints
# "SKIP: why" and exits 77, meson's "skipped". It needs the caller's `set -euo pipefail`.
# Each host has its own temporary directory (TMPDIR), as real hosts have their own /tmp: Open MPI
# keeps its session directory there, named after the hostname, which the simulated hosts share.
# With one /tmp, both hosts' daemons of a job wrote the same topology file (jf.N/hwloc.sm) at once,
# and one of them sometimes crashed before checking in (hwloc_shmem_topology_write), leaving mpirun
# waiting for it: the hang the multi-host test once had in about a third of its runs.

sim_ip_a=10.77.0.1 sim_ip_b=10.77.0.2 sim_ip_l=10.77.0.3 sim_subnet=10.77.0.0/24
# Every mpirun is bounded: a hung job (a daemon that never checks in) fails the caller, not CI.
sim_timeout=${sim_timeout:-60}

sim_skip() { echo "SKIP: $*"; exit 77; }

# sim_hosts_up MPIRUN: makes the hosts and sets what the other functions and the caller use:
#   sim_work            a temporary directory, removed on exit (the caller may keep files there)
#   sim_host_a/_b       each host's node-local directory ($ZEST_TEST_HOST_DIR of its ranks)
#   sim_ns_a/_b/_l      the namespaces
#   sim_veth_a/_b       each host's end of its link; sim_port_a/_b the bridge's end (in L)
# Installs an EXIT trap that removes the namespaces and sim_work, and makes TERM, INT and HUP exit
# through it (a timeout's SIGTERM still removes the namespaces, once the running mpirun returns).
sim_hosts_up() {
  sim_mpirun=$1
  [ "$(id -u)" = 0 ] || sim_skip "simulated hosts are network namespaces, which need root (CI runs as root)"
  command -v ip > /dev/null || sim_skip "no 'ip' command (iproute2) to make network namespaces"
  sim_work=$(mktemp -d)
  sim_host_a=$sim_work/hostA sim_host_b=$sim_work/hostB
  # The process id keeps two runs (a test and a benchmark) apart; interface names have at most 15
  # characters, hence the short ones.
  sim_ns_a=zest-mh-a-$$ sim_ns_b=zest-mh-b-$$ sim_ns_l=zest-mh-l-$$
  sim_veth_a=zmha$$ sim_veth_b=zmhb$$ sim_port_a=zmla$$ sim_port_b=zmlb$$
  trap sim_hosts_down EXIT
  trap "exit 143" TERM INT HUP
  if ! ip netns add "$sim_ns_l" 2> "$sim_work/netns.err"; then
    sim_skip "cannot create a network namespace: $(cat "$sim_work/netns.err")"
  fi
  ip netns add "$sim_ns_a"
  ip netns add "$sim_ns_b"
  local ns
  for ns in "$sim_ns_a" "$sim_ns_b" "$sim_ns_l"; do ip -n "$ns" link set lo up; done
  ip -n "$sim_ns_l" link add zbr type bridge
  ip -n "$sim_ns_l" addr add "$sim_ip_l/24" dev zbr
  ip -n "$sim_ns_l" link set zbr up
  sim_link_host "$sim_ns_a" "$sim_ip_a" "$sim_veth_a" "$sim_port_a"
  sim_link_host "$sim_ns_b" "$sim_ip_b" "$sim_veth_b" "$sim_port_b"
  mkdir -p "$sim_host_a/tmp" "$sim_host_b/tmp"

  # The rsh agent: "HOST COMMAND..." runs COMMAND on HOST, i.e. in its namespace, with its directory.
  # agent.log lists the hosts it was asked for (a test checks that B's daemon came through it).
  cat > "$sim_work/agent" << AGENT
#!/bin/sh
host=\$1
shift
case \$host in
  $sim_ip_a) ns=$sim_ns_a dir=$sim_host_a ;;
  $sim_ip_b) ns=$sim_ns_b dir=$sim_host_b ;;
  *) echo "agent: unknown host \$host" >&2; exit 1 ;;
esac
echo "\$host" >> "$sim_work/agent.log"
exec ip netns exec "\$ns" env ZEST_TEST_HOST_DIR="\$dir" TMPDIR="\$dir/tmp" sh -c "\$*"
AGENT
  # on-host PROGRAM ARGS...: runs PROGRAM with each argument @HOST@/x replaced by $ZEST_TEST_HOST_DIR/x.
  cat > "$sim_work/on-host" << 'ONHOST'
#!/bin/sh
for arg; do
  shift
  case $arg in @HOST@*) arg=$ZEST_TEST_HOST_DIR${arg#@HOST@} ;; esac
  set -- "$@" "$arg"
done
exec "$@"
ONHOST
  chmod +x "$sim_work/agent" "$sim_work/on-host"
  printf '%s slots=2\n%s slots=2\n' "$sim_ip_a" "$sim_ip_b" > "$sim_work/hostfile"
  # All traffic stays on the namespaces' addresses.
  sim_mpi_args=(--bind-to none --mca plm_rsh_agent "$sim_work/agent" --mca plm_rsh_no_tree_spawn 1 --mca pml ob1
                --mca btl_tcp_disable_family 6 --mca btl_tcp_if_include "$sim_subnet" --mca oob_tcp_if_include "$sim_subnet")
}

# sim_link_host NS IP VETH PORT: joins host NS to the bridge by the veth pair VETH (in NS, address
# IP) - PORT (in L, on the bridge).
sim_link_host() {
  local ns=$1 ip=$2 veth=$3 port=$4
  ip link add "$veth" type veth peer name "$port"
  ip link set "$veth" netns "$ns"
  ip link set "$port" netns "$sim_ns_l"
  ip -n "$sim_ns_l" link set "$port" master zbr
  ip -n "$sim_ns_l" link set "$port" up
  ip -n "$ns" addr add "$ip/24" dev "$veth"
  ip -n "$ns" link set "$veth" up
}

sim_hosts_down() {
  local ns
  for ns in "${sim_ns_a:-}" "${sim_ns_b:-}" "${sim_ns_l:-}"; do
    [ -n "$ns" ] && { ip netns del "$ns" 2> /dev/null || true; }
  done
  [ -n "${sim_work:-}" ] && rm -rf "$sim_work"
  return 0
}

# sim_hosts_limit RATE: limits each host's link to RATE (tc's units: 1gbit, 100mbit) in each
# direction, with a token bucket (tbf) on both ends of its veth pair: the host's end shapes what it
# sends, the bridge's end what it receives. A byte from A to B passes A's end and then B's bridge
# end, both at RATE, so A -> B runs at RATE, as on a switch with links of that speed. Ranks of one
# host talk over loopback (their peer's address is their own host's), which no limit touches.
# RATE `none` removes the limit (the veths then carry over 10 Gbit/s here).
# No delay: this kernel has no netem, nor fq (which would honour departure times that a BPF
# program on the veth could set), so the link is as slow as RATE says but its latency stays the
# veth's (microseconds). A user-space delay line (a TUN device) would be a program of its own, and
# would take CPU from the ranks.
sim_hosts_limit() {
  local rate=$1 bits burst end ends=("$sim_ns_a $sim_veth_a" "$sim_ns_b $sim_veth_b" "$sim_ns_l $sim_port_a" "$sim_ns_l $sim_port_b")
  command -v tc > /dev/null || sim_skip "no 'tc' command (iproute2) to limit the link"
  if [ "$rate" = none ]; then
    for end in "${ends[@]}"; do
      ip netns exec "${end% *}" tc qdisc del dev "${end#* }" root 2> /dev/null || true
    done
    return 0
  fi
  # The bucket holds 4 ms at RATE (at least 64 KiB, a whole GSO packet, which tbf would otherwise
  # split): more than a timer tick (CONFIG_HZ=250), so the rate holds between ticks. Packets queue
  # up to 20 ms before tbf drops any, so TCP sees a slow link, not a lossy one.
  bits=$(sim_rate_bits "$rate")
  burst=$((bits / 8 / 250))
  [ "$burst" -ge 65536 ] || burst=65536
  for end in "${ends[@]}"; do
    ip netns exec "${end% *}" tc qdisc replace dev "${end#* }" root tbf rate "$rate" burst "$burst" latency 20ms
  done
}

# sim_rate_bits RATE: RATE (a number and one of tc's units: bit, kbit, mbit, gbit; or plain bits
# per second) in bits per second.
sim_rate_bits() {
  local rate=${1,,} unit=1
  case $rate in
    *gbit) unit=1000000000 rate=${rate%gbit} ;;
    *mbit) unit=1000000 rate=${rate%mbit} ;;
    *kbit) unit=1000 rate=${rate%kbit} ;;
    *bit) rate=${rate%bit} ;;
  esac
  [[ $rate =~ ^[0-9]+$ ]] || { echo "sim-hosts: rate '$1' is not a whole number of bit, kbit, mbit or gbit" >&2; return 2; }
  echo $((rate * unit))
}

# sim_link_tx_bytes: the bytes both hosts have sent on their veths so far (what crossed the link
# between them, plus the little the daemons exchange with mpirun in L). Intra-host traffic goes
# over each host's loopback and is not counted.
sim_link_tx_bytes() {
  echo $(($(sim_tx_bytes "$sim_ns_a" "$sim_veth_a") + $(sim_tx_bytes "$sim_ns_b" "$sim_veth_b")))
}
# sim_loopback_tx_bytes: the bytes sent on both hosts' loopbacks so far: what ranks of one host
# sent each other (and their daemon), which the link's figure leaves out.
sim_loopback_tx_bytes() {
  echo $(($(sim_tx_bytes "$sim_ns_a" lo) + $(sim_tx_bytes "$sim_ns_b" lo)))
}
# sim_tx_bytes NS DEV: DEV's tx byte counter (sysfs shows a namespace's devices only inside it).
sim_tx_bytes() { ip netns exec "$1" cat "/sys/class/net/$2/statistics/tx_bytes"; }

# sim_hosts_write NAME: stdin into NAME in both hosts' directories, each @HOST@ in it replaced by
# the host's directory (so a config's nvme path is the host's own).
sim_hosts_write() {
  local name=$1 text dir
  text=$(cat)
  for dir in "$sim_host_a" "$sim_host_b"; do
    printf '%s\n' "${text//@HOST@/$dir}" > "$dir/$name"
  done
}

# sim_two_hosts PROGRAM ARGS...: 2 hosts x 2 ranks, mpirun on L; an argument @HOST@/x is x in each
# rank's host directory. The ranks talk over TCP only: the simulated hosts share one kernel and
# hostname, so Open MPI's shared-memory segments (/dev/shm/vader_segment.HOST.JOB.LOCALRANK) of the
# two hosts' local rank 0 would be one file. mpirun on a host of its own ranks hangs in their first
# MPI_Comm_dup (its local ranks and a remote daemon share a hostname), so it runs in L and every
# host's daemon is started alike, through the agent.
sim_two_hosts() {
  timeout "$sim_timeout" ip netns exec "$sim_ns_l" \
    "$sim_mpirun" "${sim_mpi_args[@]}" --mca btl tcp,self --hostfile "$sim_work/hostfile" -np 4 "$sim_work/on-host" "$@"
}

# sim_one_host NS DIR RANKS PROGRAM ARGS...: RANKS ranks on one host (shared memory between them).
sim_one_host() {
  local ns=$1 dir=$2 ranks=$3 host=$sim_ip_a
  shift 3
  [ "$ns" = "$sim_ns_b" ] && host=$sim_ip_b
  timeout "$sim_timeout" ip netns exec "$ns" env ZEST_TEST_HOST_DIR="$dir" TMPDIR="$dir/tmp" \
    "$sim_mpirun" "${sim_mpi_args[@]}" --mca btl vader,self --oversubscribe --host "$host:$ranks" -np "$ranks" \
    "$sim_work/on-host" "$@"
}
