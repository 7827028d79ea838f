#!/usr/bin/env bash
# Installs what zest builds with (Debian 12 packages) and configures the build directory.
# Idempotent: installs only missing packages, configures only once. Sourced by main.sh and test.sh.
set -euo pipefail

ZEST_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
ZEST_BUILD=${ZEST_BUILD:-$ZEST_ROOT/build}

packages=(build-essential git python3 pkg-config meson ninja-build
          libyaml-cpp-dev libopenmpi-dev openmpi-bin liburing-dev libtbb-dev libhwloc-dev
          nlohmann-json3-dev  # every JSON zest writes (header-only)
          libfmt-dev          # message formatting
          libgtest-dev libgmock-dev libopenblas-dev
          clang-14 libclang-rt-14-dev  # libFuzzer, for the fuzz targets (tests/fuzz)
          python3-venv python3-dev)    # the pinned PyTorch's environment (python-env.sh)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  echo "zest: installing ${missing[*]}"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# The CUDA toolkit is not a Debian package; where it is installed, the CUDA code builds too (it
# must keep compiling on machines without a GPU, where its tests skip). Meson builds it only when
# asked for (-Dcuda defaults to disabled: libzest then links no CUDA library), so ask.
ZEST_CUDA_OPTION=-Dcuda=disabled
if [ -x /usr/local/cuda/bin/nvcc ]; then
  export PATH="/usr/local/cuda/bin:$PATH"
  ZEST_CUDA_OPTION=-Dcuda=enabled
fi

# Open MPI refuses to run as root without these (containers, CI).
if [ "$(id -u)" -eq 0 ]; then
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi

source "$ZEST_ROOT/scripts/python-env.sh"

# configure_build DIR [meson options...]: configures DIR once (later calls apply the options
# given to the existing configuration), then builds it. CUDA as above, unless the options say.
configure_build() {
  local dir=$1
  shift
  set -- "$ZEST_CUDA_OPTION" "$@"
  if [ ! -f "$dir/build.ninja" ]; then
    meson setup "$dir" "$ZEST_ROOT" "$@"
  elif ! options_set "$dir" "$@"; then
    meson configure "$dir" "$@"
  fi
  ninja -C "$dir"
}

# options_set DIR -Dname=value...: whether DIR is configured with these values already (then
# `meson configure`, which regenerates the build files even for unchanged values, is skipped).
options_set() {
  local dir=$1
  shift
  meson introspect "$dir" --buildoptions 2>/dev/null | python3 -c '
import json, sys
try:
    current = {o["name"]: o["value"] for o in json.load(sys.stdin)}
except ValueError:
    sys.exit(1)
def text(v):
    if isinstance(v, list):  # cpp_args and the like: -Dcpp_args=-g1 reads back as ["-g1"]
        return " ".join(v)
    return ("true" if v else "false") if isinstance(v, bool) else str(v)
wanted = dict(a[2:].split("=", 1) for a in sys.argv[1:])   # the last value of a name counts
sys.exit(0 if all(k in current and text(current[k]) == v for k, v in wanted.items()) else 1)' "$@"
}
