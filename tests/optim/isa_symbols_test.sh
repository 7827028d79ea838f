#!/bin/sh
# The vector builds of adam_kernels.cpp must not emit a shared inline function (a weak symbol)
# that the scalar build or other code also uses: the linker keeps one copy of each, and an
# AVX-512-compiled copy would crash the scalar fallback on CPUs without AVX-512. Weak symbols
# whose signature names the build's own vector type are unique to that build and allowed, and so
# are DW.ref.* entries: data words the unwinder reads (exception personality), not code.
# usage: isa_symbols_test.sh LIB...
status=0
for lib in "$@"; do
  shared=$(nm -C "$lib" | grep -E ' [WVu] ' | grep -v '__vector' | grep -v ' DW\.ref\.' || true)
  if [ -n "$shared" ]; then
    echo "FAIL: $lib emits shared inline symbols compiled for its instruction set:"
    echo "$shared"
    status=1
  else
    echo "ok: $lib"
  fi
done
exit $status
