"""A tiny Hugging Face Llama whose config names bf16, and the token sequences it learns.

``from_pretrained`` of a bf16 checkpoint builds a bf16 model (its config says
``"dtype": "bfloat16"``); ``from_config`` of such a config does the same without a hub, so
both sides of a comparison start from the same bf16 weights, seeded. Needs transformers.
"""
from __future__ import annotations

import torch
import transformers

VOCAB, SEQ = 101, 16


def make_llama(seed: int = 0):
    """Grouped-query attention (2 key/value heads for 6 query heads), untied embeddings;
    parameters bf16, the rotary buffers fp32 (as transformers builds them)."""
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=36, intermediate_size=70, num_hidden_layers=2,
        num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=SEQ,
        dtype="bfloat16")
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config)


def make_token_dataset(samples: int = 128, seed: int = 1) -> torch.utils.data.TensorDataset:
    """Sequences counting up from a random token in a random stride (mod the vocabulary):
    a pattern the model learns within a few steps, seeded."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, VOCAB, (samples, 1), generator=g)
    stride = torch.tensor([1, 2, 3, 5])[torch.randint(0, 4, (samples, 1), generator=g)]
    return torch.utils.data.TensorDataset((start + stride * torch.arange(SEQ)) % VOCAB)
