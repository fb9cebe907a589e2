"""Save LoRA adapters with the REAL PEFT, as a user's training script would.

Run with vLLM's Python and PEFT beside it (scripts/setup.d/45-peft.sh):
``PYTHONPATH=.venv-peft .venv-vllm/bin/python tests/integration/peft_save.py MODEL JOBS``,
JOBS a JSON list of ``{"out": FOLDER, "seed": N}`` with optional ``rank``, ``targets``
(comma-separated) and ``base_name``. Each adapter is its own seeded random LoRA on a fresh
copy of the base model (``init_lora_weights=False``: both halves non-zero), so each changes
the model's output differently; one process saves them all, since importing torch, transformers
and PEFT costs seconds and saving a tiny adapter none. Nothing from loraplane is imported:
this is the trainer's side, with only torch, transformers and peft.
"""

from __future__ import annotations

import argparse
import json
from typing import Any


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model", help="the base model folder")
    parser.add_argument(
        "jobs",
        help='a JSON list of adapters to save: {"out": FOLDER, "seed": N} with optional '
        '"rank" (default 8), "targets" (default "q_proj,v_proj") and "base_name" (the name '
        "the model is known by, as when it was loaded from a hub id; default: the folder "
        "it was loaded from)",
    )
    args = parser.parse_args()
    jobs: list[dict[str, Any]] = json.loads(args.jobs)

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    for job in jobs:
        rank = int(job.get("rank", 8))
        torch.manual_seed(int(job["seed"]))
        model = AutoModelForCausalLM.from_pretrained(args.model)
        if job.get("base_name"):  # PEFT records the model's own name_or_path, whatever its
            model.name_or_path = job["base_name"]  # config says
        config = LoraConfig(
            r=rank,
            lora_alpha=2 * rank,
            target_modules=str(job.get("targets", "q_proj,v_proj")).split(","),
            init_lora_weights=False,
            task_type="CAUSAL_LM",
        )
        peft_model = get_peft_model(model, config)
        peft_model.save_pretrained(job["out"])


if __name__ == "__main__":
    main()
