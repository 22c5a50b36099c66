"""Tiny Hugging Face transformers models with awkward sizes, their global batches, and the
loop that trains a rank's share of them (the test importing this has made sure
transformers is there).

A Llama with grouped-query attention (2 key/value heads for 6 query heads), tied
embeddings, left padding and gradient checkpointing; a Qwen3 mixture of experts (left
padding; see ``qwen3_moe_config``); and a GPT-2 (Conv1D weights stored transposed, learned
positions, tied embeddings) with right padding. All are built with
``AutoModelForCausalLM.from_config`` (no hub access).
"""
from __future__ import annotations

import torch
import transformers

from .compare import worst

STEPS = 4
ROWS, SEQ = 4, 11          # the global batch
PAD = 0
VOCAB = {"llama": 101, "qwen3_moe": 89, "gpt2": 97}
MODELS = tuple(VOCAB)


def qwen3_moe_config(vocab: int):
    """A mixture of experts: 5 experts, 2 per token, stacked into 3-D parameters (sharded
    along the experts), a router, and per-head q/k norms of 6 elements placed before the
    experts in each layer's unit. Widths are multiples of 8: transformers' grouped GEMM
    wants 16-byte strides."""
    return transformers.Qwen3MoeConfig(
        vocab_size=vocab, hidden_size=24, intermediate_size=40, moe_intermediate_size=16,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=6,
        num_experts=5, num_experts_per_tok=2, max_position_embeddings=32, pad_token_id=PAD)


def build(name: str, seed: int = 0):
    """``name`` ("llama", "qwen3_moe" or "gpt2") from ``seed``, in training mode."""
    torch.manual_seed(seed)
    if name == "llama":
        config = transformers.LlamaConfig(
            vocab_size=VOCAB[name], hidden_size=36, intermediate_size=70, num_hidden_layers=2,
            num_attention_heads=6, num_key_value_heads=2, tie_word_embeddings=True,
            max_position_embeddings=32, pad_token_id=PAD)
    elif name == "qwen3_moe":
        config = qwen3_moe_config(VOCAB[name])
    else:
        config = transformers.GPT2Config(
            vocab_size=VOCAB[name], n_embd=30, n_head=3, n_layer=2, n_inner=50, n_positions=16,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, pad_token_id=PAD,
            bos_token_id=1, eos_token_id=2)
    model = transformers.AutoModelForCausalLM.from_config(config)
    if name == "llama":   # transformers 5's name; gradient_checkpointing_enable in 4.x
        enable = getattr(model, "activation_checkpointing_enable", None) \
            or model.gradient_checkpointing_enable
        enable()
    model.train()
    return model


def global_batches(name: str):
    """Per step: token ids, attention mask and labels (-100 on padding) of the global batch.
    Llama and the Qwen3 are padded on the left, GPT-2 on the right; every row has its own
    length."""
    vocab = VOCAB[name]
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(3, vocab, (ROWS, SEQ), generator=g)
        lengths = torch.randint(4, SEQ + 1, (ROWS,), generator=g)
        pos = torch.arange(SEQ).expand(ROWS, SEQ)
        mask = (pos >= SEQ - lengths[:, None]) if name != "gpt2" else (pos < lengths[:, None])
        ids = ids.masked_fill(~mask, PAD)
        out.append((ids, mask.long(), ids.masked_fill(~mask, -100)))
    return out


def tokens_predicted(labels: torch.Tensor) -> int:
    return int((labels[:, 1:] != -100).sum())


def train(model, opt, data, rank=0, world=1):
    """Each rank takes its rows; the loss is a sum over the rank's predicted tokens divided
    by the global batch's count over the world, so averaging gradients over ranks gives the
    gradient of the global batch's mean loss (as Trainer does with num_items_in_batch)."""
    for ids, mask, labels in data:
        n = tokens_predicted(labels) / world
        mine = [t.chunk(world)[rank] for t in (ids, mask, labels)]
        out = model(input_ids=mine[0], attention_mask=mine[1], labels=mine[2],
                    num_items_in_batch=torch.tensor(n))
        out.loss.backward()
        opt.step()
        opt.zero_grad()


def adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)


def reference(name: str, data, device: str = "cpu") -> dict:
    """The state dict after plain single-process training on the global batches ``data``,
    on ``device``."""
    model = build(name).to(device)
    opt = adamw(model)
    for ids, mask, labels in data:
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        opt.step()
        opt.zero_grad()
    return model.state_dict()


def max_err(a: dict, b: dict) -> float:
    return max(worst(a[k] - b[k]) for k in b)
