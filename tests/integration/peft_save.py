"""Save LoRA adapters with the REAL PEFT, as a user's training script would.

Run with vLLM's Python and PEFT beside it (scripts/setup.d/45-peft.sh):
``PYTHONPATH=.venv-peft .venv-vllm/bin/python tests/integration/peft_save.py MODEL OUT SEED``.
The weights are random but seeded (``init_lora_weights=False``: both halves non-zero), so
each adapter changes the model's output differently. Nothing from loraplane is imported:
this is the trainer's side, with only torch, transformers and peft.
"""

from __future__ import annotations

import argparse


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model", help="the base model folder")
    parser.add_argument("out", help="where save_pretrained writes the adapter")
    parser.add_argument("seed", type=int)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--targets", default="q_proj,v_proj")
    parser.add_argument(
        "--base-name",
        default=None,
        help="the name the model is known by, as when it was loaded from a "
        "hub id (default: the folder it was loaded from)",
    )
    args = parser.parse_args()

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_pretrained(args.model)
    if args.base_name:  # PEFT records the model's own name_or_path, whatever its config says
        model.name_or_path = args.base_name
    config = LoraConfig(
        r=args.rank,
        lora_alpha=2 * args.rank,
        target_modules=args.targets.split(","),
        init_lora_weights=False,
        task_type="CAUSAL_LM",
    )
    peft_model = get_peft_model(model, config)
    peft_model.save_pretrained(args.out)


if __name__ == "__main__":
    main()
