"""A Qwen3-0.6B-shaped random checkpoint in bfloat16 (445 M parameters) with a tiny model's
tokenizer, made on the GPU: the model of .ci/gpu/checks.sh's bench compare.
Usage: make_model.py TINY_QWEN3_DIR OUT_DIR"""

import json
import shutil
import sys
from pathlib import Path

import torch
import transformers

tiny, out = Path(sys.argv[1]), Path(sys.argv[2])
config = json.loads((tiny / "config.json").read_text())
for key in ("architectures", "model_type"):
    config.pop(key)
config.update(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
              num_key_value_heads=8, head_dim=128, layer_types=["full_attention"] * 28, max_window_layers=28,
              max_position_embeddings=8192, torch_dtype="bfloat16")
torch.manual_seed(0)
with torch.device("cuda"):
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**config)).to(torch.bfloat16)
model.save_pretrained(out, safe_serialization=True)
for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
    shutil.copy(tiny / name, out / name)
print(f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters")
