#!/usr/bin/env bash
# zest as a Meson subproject of a trainer's build, the way README's "Using zest from a trainer"
# shows it: README's wrap file in subprojects/, the zest source tree as subprojects/zest (a
# symlink: offline, Meson uses the directory a wrap names when it exists), and a trainer whose
# meson.build calls dependency('zest') and, where zest-torch is built, dependency('zest-torch').
# It configures the trainer and compiles its programs against both dependencies; with --link it
# also builds zest inside the trainer's build (minutes) and runs them.
# usage: subproject_test.sh SOURCE_DIR [--torch[=TORCH_DIR]] [--link]
set -euo pipefail
source=$1
shift
source "$source/tests/install/no_zest_path.sh"
torch=no torch_dir='' link=no
for arg in "$@"; do
  case "$arg" in
    --torch) torch=yes ;;
    --torch=*) torch=yes torch_dir=${arg#--torch=} ;;
    --link) link=yes ;;
    *) echo "usage: $0 SOURCE_DIR [--torch[=TORCH_DIR]] [--link]" >&2; exit 2 ;;
  esac
done
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
trainer=$stage/trainer
mkdir -p "$trainer/subprojects"

awk '/^## Using zest from a trainer/ { section = 1 } section && /^```ini$/ { code = 1; next }
     code && /^```$/ { exit } code' "$source/README.md" >"$trainer/subprojects/zest.wrap"
[ -s "$trainer/subprojects/zest.wrap" ] ||
  { echo "FAIL: no wrap file (an ini block) under README's 'Using zest from a trainer'"; exit 1; }
ln -s "$source" "$trainer/subprojects/zest"

cat >"$trainer/trainer.cpp" <<'CPP'
#include <zest/zest.hpp>
#include <cstdio>
int main() {
  auto device = zest::make_cpu_device(1 << 20);
  zest::DeviceBuffer buffer = device->allocate(4096, zest::MemoryCategory::params);
  std::printf("trainer: ok\n");
  return 0;
}
CPP
cat >"$trainer/torch_trainer.cpp" <<'CPP'
#include <torch/torch.h>
#include <zest/torch.hpp>
#include <cstdio>
int main() {
  zest::Config config = zest::parse_config("device:\n  type: cpu\n  memory: 64MiB\n");
  zest::Runtime runtime(config);
  auto linear = torch::nn::Linear(4, 2);
  zest::torch::Optimizer opt(linear->named_parameters(), config, &runtime);
  std::printf("torch_trainer: ok\n");
  return 0;
}
CPP
{
  echo "project('trainer', 'cpp', default_options: ['cpp_std=c++20', 'warning_level=3', 'werror=true'])"
  echo "executable('trainer', 'trainer.cpp', dependencies: dependency('zest'))"
  if [ "$torch" = yes ]; then
    echo "executable('torch_trainer', 'torch_trainer.cpp', dependencies: dependency('zest-torch'))"
  fi
} >"$trainer/meson.build"

options=()
[ "$torch" = yes ] && options+=(-Dzest:torch=enabled -Dzest:torch_dir="$torch_dir")
if ! meson setup "$stage/build" "$trainer" "${options[@]}" >"$stage/setup.log" 2>&1; then
  cat "$stage/setup.log"
  echo "FAIL: the trainer's build does not configure with zest as a subproject (wrap file:)"
  cat "$trainer/subprojects/zest.wrap"
  exit 1
fi
programs=(trainer)
[ "$torch" = yes ] && programs+=(torch_trainer)

# Each program links the subproject's libraries.
for program in "${programs[@]}"; do
  line=$(grep "^build $program: " "$stage/build/build.ninja") ||
    { echo "FAIL: no link step for $program"; exit 1; }
  wants=(subprojects/zest/src/libzest.so)
  [ "$program" = torch_trainer ] && wants+=(subprojects/zest/src/torch/libzest-torch.so)
  for want in "${wants[@]}"; do
    grep -q "$want" <<<"$line" || { echo "FAIL: $program does not link $want: $line"; exit 1; }
  done
done

if [ "$link" = yes ]; then
  ninja -C "$stage/build" "${programs[@]}" >"$stage/ninja.log" 2>&1 ||
    { tail -50 "$stage/ninja.log"; echo "FAIL: the trainer's build fails"; exit 1; }
  for program in "${programs[@]}"; do
    no_zest_path "$stage/build/$program"
  done
  echo "ok: ${programs[*]} built with zest as a subproject, and ran"
else
  # Only the trainer's own objects: they compile against both dependencies' headers and flags.
  objects=()
  for program in "${programs[@]}"; do objects+=("$program.p/$program.cpp.o"); done
  ninja -C "$stage/build" "${objects[@]}" >"$stage/ninja.log" 2>&1 ||
    { tail -50 "$stage/ninja.log"; echo "FAIL: the trainer's programs do not compile against zest as a subproject"; exit 1; }
  echo "ok: ${programs[*]} configured and compiled with zest as a subproject (--link builds and runs them)"
fi
