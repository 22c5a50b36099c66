"""Hugging Face transformers models in a plain loop: every stage, world 1 and 2, fp32 and bf16.

Three tiny configs with awkward sizes: a Llama with grouped-query attention (2 key/value
heads for 6 query heads), tied embeddings, left padding and gradient checkpointing; a
Qwen3 mixture of experts (left padding; see ``qwen3_moe_config``); and a GPT-2 (Conv1D
weights stored transposed, learned positions, tied embeddings) with right padding. All are
built with ``AutoModelForCausalLM.from_config`` (no hub access).

fp32 is compared with plain single-process PyTorch on the same global batch, as
test_parity.py does. bf16 is compared bit for bit with FSDP2 under the same policy (bf16
parameters and all-gather, fp32 reduction, fp32 masters), and loosely with fp32.
"""
from __future__ import annotations

import pytest
import torch

import zerofn as zf
from support.models import worst
from support.ranks import run_ranks
from test_parity import STAGES, TOL

transformers = pytest.importorskip("transformers")

STEPS = 4
ROWS, SEQ = 4, 11          # the global batch
PAD = 0
# bf16 against fp32 bounds gross errors only: AdamW moves an element by about lr per step
# whatever its gradient's size, so where a gradient is near zero bf16 rounding can flip the
# step, up to 2 * lr * STEPS = 8e-3 apart (measured: up to 3.5e-3). The check that matters
# is FSDP2's, bit for bit.
TOL_BF16_VS_FP32 = 1e-2
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


def reference(name: str, data) -> dict:
    model = build(name)
    opt = adamw(model)
    for ids, mask, labels in data:
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        opt.step()
        opt.zero_grad()
    return model.state_dict()


def fsdp2_bf16(name: str, data, rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    model = build(name)
    mesh = init_device_mesh("cpu", (world,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in (model.transformer.h if name == "gpt2" else model.model.layers):
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    opt = adamw(model)
    train(model, opt, data, rank, world)
    return {k: v.full_tensor() for k, v in model.state_dict().items()}


def max_err(a: dict, b: dict) -> float:
    return max(worst(a[k] - b[k]) for k in b)


def every_config(rank, world):
    """Every model x every stage x fp32/bf16, in one process per rank."""
    out = {}
    for name in MODELS:
        data = global_batches(name)
        fp32 = reference(name, data)
        fsdp2 = fsdp2_bf16(name, data, rank, world)
        for stage in (1, 2, 3):
            for bf16 in (False, True):
                model = build(name)
                opt = adamw(model)
                parts = [getattr(zf, t)() for t in STAGES[stage]]
                if bf16:
                    parts.append(zf.mixed_precision(torch.bfloat16, reduce_dtype=torch.float32))
                model, opt = zf.compose(*parts)(model, opt)
                train(model, opt, data, rank, world)
                msd, _ = zf.get_state_dict(model, opt, full=True)
                out[name, stage, bf16] = (max_err(msd, fp32), max_err(msd, fsdp2) if bf16 else None)
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_hf_models_follow_plain_pytorch(world):
    for rank, results in enumerate(run_ranks(world, every_config, timeout=400)):
        for (name, stage, bf16), (vs_fp32, vs_fsdp2) in results.items():
            where = f"world {world} rank {rank} {name} stage {stage} {'bf16' if bf16 else 'fp32'}"
            if bf16:
                assert vs_fsdp2 == 0.0, (where, vs_fsdp2)
                assert vs_fp32 < TOL_BF16_VS_FP32, (where, vs_fp32)
            else:
                assert vs_fp32 < TOL, (where, vs_fp32)


def test_padding_and_grouped_query_attention_are_exercised():
    """The comparisons above mean something only if rows differ in length, padding sits
    where the masks say, and the Llama really shares key/value heads and checkpoints."""
    for name in ("llama", "gpt2"):
        ids, mask, labels = global_batches(name)[0]
        assert len(set(mask.sum(1).tolist())) > 1
        assert (ids[mask == 0] == PAD).all() and (labels[mask == 0] == -100).all()
    model = build("llama")
    attn = model.model.layers[0].self_attn
    assert attn.k_proj.out_features * 3 == attn.q_proj.out_features   # 2 kv heads for 6
    assert getattr(model, "is_activation_checkpointing", None) or model.is_gradient_checkpointing
    assert model.lm_head.weight is model.model.embed_tokens.weight
    gpt2 = build("gpt2")
    assert gpt2.lm_head.weight is gpt2.transformer.wte.weight
