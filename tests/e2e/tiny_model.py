"""A tiny random-weight Llama written locally: config, safetensors weights and a word-level
tokenizer (token ``t<i>`` is id ``i``), so no engine ever reaches a model hub."""

from __future__ import annotations

import json
from pathlib import Path

LAYERS = 3
HIDDEN = 128
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 32
FFN = 256
VOCAB = 1000
BOS, EOS = 1, 2
FIRST_WORD = 3  # ids below are special tokens

CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": HIDDEN,
    "intermediate_size": FFN,
    "num_attention_heads": HEADS,
    "num_key_value_heads": KV_HEADS,
    "head_dim": HEAD_DIM,
    "num_hidden_layers": LAYERS,
    "vocab_size": VOCAB,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": BOS,
    "eos_token_id": EOS,
}


def _weights(seed: int) -> dict:
    import torch

    gen = torch.Generator().manual_seed(seed)

    def normal(*shape: int, std: float = 0.1) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * std).to(torch.bfloat16)

    def ones(size: int) -> torch.Tensor:
        return torch.ones(size, dtype=torch.bfloat16)

    weights = {"model.embed_tokens.weight": normal(VOCAB, HIDDEN, std=1.0)}
    for i in range(LAYERS):
        layer = f"model.layers.{i}"
        weights.update(
            {
                f"{layer}.input_layernorm.weight": ones(HIDDEN),
                f"{layer}.post_attention_layernorm.weight": ones(HIDDEN),
                f"{layer}.self_attn.q_proj.weight": normal(HEADS * HEAD_DIM, HIDDEN),
                f"{layer}.self_attn.k_proj.weight": normal(KV_HEADS * HEAD_DIM, HIDDEN),
                f"{layer}.self_attn.v_proj.weight": normal(KV_HEADS * HEAD_DIM, HIDDEN),
                f"{layer}.self_attn.o_proj.weight": normal(HIDDEN, HEADS * HEAD_DIM),
                f"{layer}.mlp.gate_proj.weight": normal(FFN, HIDDEN),
                f"{layer}.mlp.up_proj.weight": normal(FFN, HIDDEN),
                f"{layer}.mlp.down_proj.weight": normal(HIDDEN, FFN),
            }
        )
    weights["model.norm.weight"] = ones(HIDDEN)
    weights["lm_head.weight"] = normal(VOCAB, HIDDEN)
    return weights


def _tokenizer_json() -> dict:
    vocab = {f"t{i}": i for i in range(VOCAB)}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {"id": i, "content": f"t{i}", "single_word": False, "lstrip": False,
             "rstrip": False, "normalized": False, "special": True}
            for i in range(FIRST_WORD)
        ],
        "normalizer": None,
        "pre_tokenizer": {"type": "WhitespaceSplit"},
        "post_processor": None,
        "decoder": None,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "t0"},
    }  # fmt: skip


def write_tiny_llama(folder: Path, seed: int = 0) -> Path:
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(CONFIG))
    (folder / "generation_config.json").write_text(
        json.dumps({"bos_token_id": BOS, "eos_token_id": EOS})
    )
    save_file(_weights(seed), str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "tokenizer.json").write_text(json.dumps(_tokenizer_json()))
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "unk_token": "t0",
                "bos_token": f"t{BOS}",
                "eos_token": f"t{EOS}",
                "model_max_length": 4096,
            }
        )
    )
    return folder


def words(count: int, start: int) -> list[int]:
    """``count`` token ids from the word range, a deterministic sequence per ``start``."""
    span = VOCAB - FIRST_WORD
    return [FIRST_WORD + (start + 7 * i) % span for i in range(count)]
