"""A tiny random-weight Llama written locally: config, safetensors weights and a word-level
tokenizer (token ``t<i>`` is id ``i``), so no engine ever reaches a model hub."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
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


@dataclass(frozen=True)
class Shape:
    """A model geometry: the suite's tiny model by default, larger ones for benchmarks."""

    layers: int = LAYERS
    hidden: int = HIDDEN
    heads: int = HEADS
    kv_heads: int = KV_HEADS
    head_dim: int = HEAD_DIM
    ffn: int = FFN

    def page_bytes(self, block: int) -> int:
        """Bytes of one layer's page of ``block`` tokens (K and V, bf16)."""
        return 2 * block * self.kv_heads * self.head_dim * 2


TINY = Shape()
# 8 layers, hidden 512, 4 KV heads (29M parameters): 4x the layers-times-page bytes per token
WIDE = replace(TINY, layers=8, hidden=512, heads=8, kv_heads=4, head_dim=64, ffn=1792)

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


def _config(shape: Shape) -> dict:
    return {
        **CONFIG,
        "hidden_size": shape.hidden,
        "intermediate_size": shape.ffn,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "head_dim": shape.head_dim,
        "num_hidden_layers": shape.layers,
    }


def _weights(seed: int, shape: Shape) -> dict:
    import torch

    gen = torch.Generator().manual_seed(seed)

    def normal(*dims: int, std: float = 0.1) -> torch.Tensor:
        return (torch.randn(*dims, generator=gen) * std).to(torch.bfloat16)

    def ones(size: int) -> torch.Tensor:
        return torch.ones(size, dtype=torch.bfloat16)

    hidden, attention, kv = (
        shape.hidden,
        shape.heads * shape.head_dim,
        shape.kv_heads * shape.head_dim,
    )
    weights = {"model.embed_tokens.weight": normal(VOCAB, hidden, std=1.0)}
    for i in range(shape.layers):
        layer = f"model.layers.{i}"
        weights.update(
            {
                f"{layer}.input_layernorm.weight": ones(hidden),
                f"{layer}.post_attention_layernorm.weight": ones(hidden),
                f"{layer}.self_attn.q_proj.weight": normal(attention, hidden),
                f"{layer}.self_attn.k_proj.weight": normal(kv, hidden),
                f"{layer}.self_attn.v_proj.weight": normal(kv, hidden),
                f"{layer}.self_attn.o_proj.weight": normal(hidden, attention),
                f"{layer}.mlp.gate_proj.weight": normal(shape.ffn, hidden),
                f"{layer}.mlp.up_proj.weight": normal(shape.ffn, hidden),
                f"{layer}.mlp.down_proj.weight": normal(hidden, shape.ffn),
            }
        )
    weights["model.norm.weight"] = ones(hidden)
    weights["lm_head.weight"] = normal(VOCAB, hidden)
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


def write_tiny_llama(folder: Path, seed: int = 0, shape: Shape = TINY) -> Path:
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(_config(shape)))
    (folder / "generation_config.json").write_text(
        json.dumps({"bos_token_id": BOS, "eos_token_id": EOS})
    )
    save_file(_weights(seed, shape), str(folder / "model.safetensors"), metadata={"format": "pt"})
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
