# Sourced by the tests that run installed programs. no_zest_path CMD...: runs CMD as a user would,
# with no LD_LIBRARY_PATH leading to zest: the environment's less every directory holding a libzest
# (`meson test` adds the build's). What stays is a prefix of third-party libraries that only
# LD_LIBRARY_PATH can reach (scripts/gpu-kit's: their own dependencies lie there too, and no rpath
# of zest's can lead a library to its dependencies); elsewhere none stays, as `env -u`.
no_zest_path() {
  local kept=() dirs=() dir
  IFS=: read -ra dirs <<<"${LD_LIBRARY_PATH:-}"
  for dir in "${dirs[@]}"; do
    [ -n "$dir" ] && ! compgen -G "$dir/libzest*.so*" >/dev/null && kept+=("$dir")
  done
  if ((${#kept[@]})); then
    (IFS=:; exec env LD_LIBRARY_PATH="${kept[*]}" "$@")
  else
    env -u LD_LIBRARY_PATH "$@"
  fi
}
