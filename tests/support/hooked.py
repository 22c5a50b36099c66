"""A small language model whose state dict its own hooks shape, every kind torch offers:

- ``FusedQKV``: q, k and v in one ``wqkv`` Linear, saved as ``wq``/``wk``/``wv`` and merged
  back on load, as torchtitan's ``FusedQKVLinear`` (the private ``_register_state_dict_hook``
  and ``_register_load_state_dict_pre_hook``);
- ``FusedGateUp``: the feed-forward's gate and up rows in one ``w13``, saved as ``w1`` and
  ``w3`` (the public ``register_state_dict_post_hook`` and
  ``register_load_state_dict_pre_hook``);
- ``Norm``: a parameter renamed ``weight`` -> ``scale``, whose old name a load still
  takes (``register_load_state_dict_pre_hook``);
- ``Calls``: a forward count kept in a buffer for the state dict
  (``register_state_dict_pre_hook`` writes it, ``register_load_state_dict_post_hook``
  reads it back).

Sizes are awkward on purpose: the vocabulary's 41 rows do not split evenly over two ranks,
and ``wq``'s 24 rows end inside rank 1's half of ``wqkv``'s 40. Below the model: the same
under FSDP2, saved and loaded as torchtitan does.
"""
from __future__ import annotations

import copy

import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

VOCAB, WIDTH, HEAD, HEADS, KV_HEADS, HIDDEN, CONTEXT = 41, 24, 8, 3, 1, 36, 10
# What the hooks put in a state dict in place of the model's own names.
SPLIT_KEYS = ["attn.wq.weight", "attn.wq.bias", "attn.wk.weight", "attn.wk.bias",
              "attn.wv.weight", "attn.wv.bias", "mlp.w1.weight", "mlp.w3.weight"]


class FusedQKV(nn.Module):
    def __init__(self):
        super().__init__()
        self.sizes = [HEADS * HEAD, KV_HEADS * HEAD, KV_HEADS * HEAD]
        self.wqkv = nn.Linear(WIDTH, sum(self.sizes))
        self._register_state_dict_hook(FusedQKV._split)
        self._register_load_state_dict_pre_hook(FusedQKV._merge, with_module=True)

    def forward(self, x):
        # (copies: FSDP2 warns of a module returning views)
        return tuple(h.clone() for h in self.wqkv(x).split(self.sizes, dim=-1))

    @staticmethod
    def _split(module, state_dict, prefix, local_metadata):
        for kind in ("weight", "bias"):
            parts = torch.split(state_dict.pop(f"{prefix}wqkv.{kind}"), module.sizes, dim=0)
            for name, part in zip(("wq", "wk", "wv"), parts):
                state_dict[f"{prefix}{name}.{kind}"] = part

    @staticmethod
    def _merge(module, state_dict, prefix, *args):
        for kind in ("weight", "bias"):
            keys = [f"{prefix}{name}.{kind}" for name in ("wq", "wk", "wv")]
            if all(k in state_dict for k in keys):
                state_dict[f"{prefix}wqkv.{kind}"] = torch.cat([state_dict.pop(k) for k in keys])


class FusedGateUp(nn.Module):
    def __init__(self):
        super().__init__()
        self.w13 = nn.Parameter(torch.randn(2 * HIDDEN, WIDTH) * WIDTH ** -0.5)
        self.w2 = nn.Linear(HIDDEN, WIDTH, bias=False)
        self.register_state_dict_post_hook(FusedGateUp._split)
        self.register_load_state_dict_pre_hook(FusedGateUp._merge)

    def forward(self, x):
        gate, up = (x @ self.w13.t()).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)

    @staticmethod
    def _split(module, state_dict, prefix, local_metadata):
        w1, w3 = state_dict.pop(f"{prefix}w13").chunk(2, dim=0)
        state_dict[f"{prefix}w1.weight"], state_dict[f"{prefix}w3.weight"] = w1, w3

    @staticmethod
    def _merge(module, state_dict, prefix, *args):
        keys = [f"{prefix}w1.weight", f"{prefix}w3.weight"]
        if all(k in state_dict for k in keys):
            state_dict[f"{prefix}w13"] = torch.cat([state_dict.pop(k) for k in keys])


class Norm(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(WIDTH))
        self.register_load_state_dict_pre_hook(Norm._legacy_name)

    def forward(self, x):
        return F.rms_norm(x, (WIDTH,), self.scale)

    @staticmethod
    def _legacy_name(module, state_dict, prefix, *args):
        if f"{prefix}weight" in state_dict:
            state_dict[f"{prefix}scale"] = state_dict.pop(f"{prefix}weight")


class Calls(nn.Module):
    """Forward calls, a plain int, carried into state dicts by a buffer."""

    def __init__(self):
        super().__init__()
        self.count = 0
        self.register_buffer("seen", torch.zeros((), dtype=torch.int64))
        self.register_state_dict_pre_hook(Calls._store)
        self.register_load_state_dict_post_hook(Calls._read)

    def tick(self):
        self.count += 1

    @staticmethod
    def _store(module, prefix, keep_vars):
        module.seen.fill_(module.count)

    @staticmethod
    def _read(module, incompatible_keys):
        module.count = int(module.seen)


class HookedLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, WIDTH)
        self.attn = FusedQKV()
        self.wo = nn.Linear(HEADS * HEAD, WIDTH, bias=False)
        self.mlp = FusedGateUp()
        self.norm = Norm()
        self.calls = Calls()
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, idx, targets):
        self.calls.tick()
        x = self.tok(idx)
        b, t, _ = x.shape
        q, k, v = (h.view(b, t, -1, HEAD).transpose(1, 2) for h in self.attn(x))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.wo(y.transpose(1, 2).reshape(b, t, -1))
        x = x + self.mlp(x)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.view(-1, VOCAB), targets.reshape(-1))


def hooked_model(seed: int = 0):
    """A ``HookedLM`` and its AdamW."""
    torch.manual_seed(seed)
    model = HookedLM()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def hooked_batches(steps: int, world: int, per_rank: int = 2, seed: int = 1):
    """``steps`` global batches of ``world * per_rank`` rows: (tokens, targets)."""
    g = torch.Generator().manual_seed(seed)
    return [tuple(torch.randint(0, VOCAB, (world * per_rank, CONTEXT), generator=g)
                  for _ in range(2)) for _ in range(steps)]


def train(model, opt, data, rank: int, world: int) -> None:
    """This rank's rows of each global batch, one step each (zerofn or FSDP2 alike)."""
    for x, y in data:
        rows = len(x) // world
        model(x[rank * rows:(rank + 1) * rows], y[rank * rows:(rank + 1) * rows]).backward()
        opt.step()
        opt.zero_grad()


# -- the same model under FSDP2, saved and loaded as torchtitan does -----------------------
def fsdp2_hooked(world: int, seed: int = 0):
    """``hooked_model(seed)`` under FSDP2 (the attention, the feed-forward, then the root)
    on a 1-D mesh of ``world`` ranks."""
    model, _ = hooked_model(seed)
    mesh = init_device_mesh("cpu", (world,))
    for part in (model.attn, model.mlp, model):
        fully_shard(part, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def fsdp2_state(model, opt, full: bool):
    """What torchtitan checkpoints: ``model.state_dict()`` (torch's ``get_state_dict``
    refuses keys a hook renamed, which name no attribute) and the optimizer's state by
    parameter FQN; ``full``: every tensor whole, a copy."""
    osd = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=full))
    msd = model.state_dict()
    if not full:
        return msd, osd
    return ({k: v.full_tensor() if isinstance(v, DTensor) else v.clone() for k, v in msd.items()},
            copy.deepcopy(osd))


def fsdp2_load(model, opt, path: str) -> None:
    """Load a DCP checkpoint of ``{"model", "optim"}`` into the FSDP2 model: its own
    ``load_state_dict`` merges what its hooks split."""
    msd, osd = fsdp2_state(model, opt, full=False)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=path)
    model.load_state_dict(state["model"])
    set_optimizer_state_dict(model, opt, state["optim"])
