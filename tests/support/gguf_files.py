"""Small GGUF files written as llama.cpp writes them, from tiny HF checkpoints."""

from __future__ import annotations

from pathlib import Path


def finish(writer) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()



# llama.cpp's tensor names for a Qwen 3 checkpoint (HF suffix -> GGUF suffix), spelled out
# here independently of pd/models/gguf.py's map.
LLAMA_CPP_QWEN3 = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def write_qwen3_gguf(folder: Path, out: Path, quantize_matrices: bool) -> None:
    """The tiny HF Qwen 3 at `folder` as llama.cpp would write it (matrices in Q8_0 if asked)."""
    import json

    import gguf
    from safetensors.torch import load_file

    config = json.loads((folder / "config.json").read_text())
    writer = gguf.GGUFWriter(str(out), "qwen3")
    for method, key in [("block_count", "num_hidden_layers"), ("context_length", "max_position_embeddings"),
                        ("embedding_length", "hidden_size"), ("feed_forward_length", "intermediate_size"),
                        ("head_count", "num_attention_heads"), ("head_count_kv", "num_key_value_heads"),
                        ("key_length", "head_dim"), ("value_length", "head_dim"),
                        ("layer_norm_rms_eps", "rms_norm_eps"), ("rope_freq_base", "rope_theta"),
                        ("vocab_size", "vocab_size"), ("eos_token_id", "eos_token_id")]:
        getattr(writer, f"add_{method}")(config[key])
    for name, tensor in load_file(str(folder / "model.safetensors")).items():
        if name == "model.embed_tokens.weight":
            gguf_name = "token_embd.weight"
        elif name == "model.norm.weight":
            gguf_name = "output_norm.weight"
        else:
            _, _, index, suffix = name.split(".", 3)
            gguf_name = f"blk.{index}.{LLAMA_CPP_QWEN3[suffix]}"
        data = tensor.float().numpy()
        if quantize_matrices and data.ndim == 2:
            q = gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(gguf_name, q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(gguf_name, data)
    finish(writer)
