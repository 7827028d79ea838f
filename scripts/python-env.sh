#!/usr/bin/env bash
# Sourced by setup.sh. zest_python_env makes (once per machine) the virtual environment holding
# the pinned PyTorch of python/requirements.txt, then the peers of `zest bench adam --peers`
# (python/requirements-peers.txt: DeepSpeed, whose CPU Adam op it builds), and sets ZEST_VENV and
# ZEST_TORCH_DIR.
#
# It lives outside the clone, in ${XDG_CACHE_HOME:-~/.cache}/zest/, named after the torch pin,
# so every clone and CI run on the machine reuses it instead of downloading ~2.7 GB again (PyPI's
# Linux torch wheel is a CUDA build: torch ~530 MB plus the nvidia-* CUDA 13 libraries it
# depends on; 4.6 GB installed; about a minute here). ZEST_VENV=DIR chooses another place.

zest_python_env() {
  local requirements=$ZEST_ROOT/python/requirements.txt peers=$ZEST_ROOT/python/requirements-peers.txt
  local torch_pin python=${ZEST_PYTHON:-/usr/bin/python3}
  torch_pin=$(sed -n 's/^torch==//p' "$requirements")
  local pyver
  pyver=$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
  ZEST_VENV=${ZEST_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/zest/torch$torch_pin-py$pyver}
  mkdir -p "$(dirname "$ZEST_VENV")"
  # One installer at a time (two clones set up at once); the stamp says which requirements the
  # environment holds, so an edited requirements file is installed on top (the peers again after
  # requirements.txt, which may have replaced what they were built against).
  (
    flock -w 1800 9 || { echo "zest: waited 30 min for $ZEST_VENV.lock" >&2; exit 1; }
    if ! cmp -s "$requirements" "$ZEST_VENV/zest-requirements.txt"; then
      echo "zest: making the Python environment $ZEST_VENV (torch $torch_pin from PyPI, ~2.7 GB)"
      [ -x "$ZEST_VENV/bin/python" ] || "$python" -m venv "$ZEST_VENV"
      "$ZEST_VENV/bin/pip" install --quiet --progress-bar off -r "$requirements"
      cp "$requirements" "$ZEST_VENV/zest-requirements.txt"
      rm -f "$ZEST_VENV/zest-requirements-peers.txt"
    fi
    if ! cmp -s "$peers" "$ZEST_VENV/zest-requirements-peers.txt"; then
      # DeepSpeed is an sdist whose setup.py imports torch: built here against the pinned torch
      # (--no-build-isolation), pip downloads no second torch (~1 MB of packages, seconds). Then
      # its CPU Adam op, as DeepSpeedCPUAdam builds it on first use, into the environment
      # (TORCH_EXTENSIONS_DIR, as bench/adam_peers.py sets it; about 30 s on 2 cores).
      echo "zest: installing DeepSpeed into $ZEST_VENV and building its CPU Adam op (~40 s)"
      "$ZEST_VENV/bin/pip" install --quiet --progress-bar off --no-build-isolation -r "$peers"
      DS_ACCELERATOR=cpu TORCH_EXTENSIONS_DIR="$ZEST_VENV/torch_extensions" "$ZEST_VENV/bin/python" -c \
        'from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load()' >/dev/null
      cp "$peers" "$ZEST_VENV/zest-requirements-peers.txt"
    fi
  ) 9>"$ZEST_VENV.lock"
  ZEST_TORCH_DIR=$("$ZEST_VENV/bin/python" -c 'import os, torch; print(os.path.dirname(torch.__file__))')
  export ZEST_VENV ZEST_TORCH_DIR
}
