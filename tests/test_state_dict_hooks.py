"""A model's own state-dict hooks shape zerofn's state dicts, checkpoints and Hugging Face
files as they shape ``model.state_dict()``: a fused projection saved as its parts and merged
back on load (torchtitan's FusedQKVLinear), an old parameter name accepted on load, a
buffer its pre-hook fills. Values come from the fp32 masters; checkpoints move between
zerofn and FSDP2 both ways, at another world size."""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from torch.distributed.tensor import DTensor

import zerofn as zf
from support.compare import max_error
from support.hooked import (SPLIT_KEYS, HookedLM, fsdp2_hooked, fsdp2_load, fsdp2_state,
                            hooked_batches, hooked_model, train)
from support.loops import zero
from support.ranks import run_ranks
from zerofn.checkpoint import load_checkpoint, save_checkpoint
from zerofn.io.pretrained import load as pretrained_load

pytestmark = pytest.mark.multirank

STEPS = 2
# zerofn's side: every stage, with and without its optimizer state on the host.
CONFIGS = {f"zero{stage}{'-offload' if host else ''}": (stage, host)
           for stage in (1, 2, 3) for host in (False, True)}


def zerofn_hooked(config: str, seed: int = 0):
    stage, host = CONFIGS[config]
    extra = [zf.offload("cpu")] if host else []
    return zf.compose(zero(stage), *extra)(*hooked_model(seed))


def plain_only(state) -> bool:
    """No DTensor anywhere in a (model, optimizer) state."""
    msd, osd = state
    return not any(isinstance(v, DTensor) for v in msd.values()) and \
        not any(isinstance(v, DTensor) for st in osd["state"].values() for v in st.values())


# -- checkpoints between zerofn and FSDP2 ------------------------------------------------
def write(rank, world, root) -> dict:
    """Train each side and checkpoint it, sharded and whole; return each checkpoint's full
    state at the save, by checkpoint directory name."""
    data = hooked_batches(STEPS, world)
    saved = {}
    fmodel, fopt = fsdp2_hooked(world)
    train(fmodel, fopt, data, rank, world)
    for form, full in (("sharded", False), ("full", True)):
        msd, osd = fsdp2_state(fmodel, fopt, full)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(root, f"fsdp2-{form}"))
    saved["fsdp2"] = fsdp2_state(fmodel, fopt, full=True)
    for config in CONFIGS:
        model, opt = zerofn_hooked(config)
        train(model, opt, data, rank, world)
        save_checkpoint(os.path.join(root, f"{config}-sharded"), model, opt, step=STEPS)
        state = zf.get_state_dict(model, opt, full=True)
        assert plain_only(state) and set(SPLIT_KEYS) <= set(state[0])
        dcp.save({"model": state[0], "optim": state[1]},
                 checkpoint_id=os.path.join(root, f"{config}-full"))
        saved[config] = state
    return saved


def read(rank, world, root) -> dict:
    """Load the other side's checkpoints (FSDP2 each of zerofn's, zerofn each config
    FSDP2's); return the full state each load gave, by checkpoint name and reader."""
    loaded = {}
    for config in CONFIGS:
        for form in ("sharded", "full"):
            fmodel, fopt = fsdp2_hooked(world, seed=7)
            path = os.path.join(root, f"{config}-{form}")
            fsdp2_load(fmodel, fopt, os.path.join(path, "step-00000002")
                       if form == "sharded" else path)
            loaded[f"{config}-{form}", "fsdp2"] = fsdp2_state(fmodel, fopt, full=True)
            model, opt = zerofn_hooked(config, seed=7)
            assert load_checkpoint(os.path.join(root, f"fsdp2-{form}"), model, opt) == {}
            loaded[f"fsdp2-{form}", config] = zf.get_state_dict(model, opt, full=True)
            assert model.calls.count == STEPS    # the load post-hook read the saved count
    return loaded


def read_then_write(rank, world, old, new):
    return read(rank, world, old), write(rank, world, new)


def errors(saved: dict, loaded: dict) -> dict:
    """How far each load is from the state its checkpoint was saved from."""
    return {(ckpt, reader): max_error(saved[ckpt.rsplit("-", 1)[0]], state)
            for (ckpt, reader), state in loaded.items()}


def test_hooked_checkpoints_move_between_zerofn_and_fsdp2_across_world_sizes(tmp_path):
    """zerofn (ZeRO-1, 2 and 3, with and without offload) and FSDP2 checkpoint the same
    hooked model, sharded and whole: each loads the other's, 2 ranks to 1 and 1 to 2, and
    holds the state saved; the fused weights are saved as their parts, by their hooks."""
    two, one = str(tmp_path / "two"), str(tmp_path / "one")
    saved_2 = run_ranks(2, write, two)[0]
    loaded_1, saved_1 = run_ranks(1, read_then_write, two, one)[0]
    loaded_2 = run_ranks(2, read, one)[0]
    for saved, loaded in ((saved_2, loaded_1), (saved_1, loaded_2)):
        assert len(loaded) == 4 * len(CONFIGS)
        for what, err in errors(saved, loaded).items():
            assert err == 0.0, f"{what}: {err}"      # a load copies: exact
        for state in saved.values():
            assert set(SPLIT_KEYS) <= set(state[0]) and "attn.wqkv.weight" not in state[0]
            assert "attn.wqkv.weight" in state[1]["state"]    # optimizer state by FQN


# -- values from the masters -----------------------------------------------------------
def full_master(opt, model, name: str) -> torch.Tensor:
    """The parameter ``name``'s master, whole: the optimizer steps this rank's rows."""
    rows = dict(zip((n for n, _ in model.named_parameters()), opt.param_groups[0]["params"]))
    pieces = [None] * dist.get_world_size()
    dist.all_gather_object(pieces, rows[name].detach().cpu())
    return torch.cat(pieces)


def from_masters(rank, world):
    out = {}
    for stage in (1, 2, 3):
        model, opt = zf.compose(zero(stage), zf.mixed_precision(torch.bfloat16))(*hooked_model())
        train(model, opt, hooked_batches(3, world), rank, world)
        master = full_master(opt, model, "attn.wqkv.weight")
        wq = master[:24]
        full = zf.get_state_dict(model, opt, full=True)
        sharded, _ = zf.get_state_dict(model, opt)
        out[stage] = {
            "plain": plain_only(full),
            "dtypes": {full[0]["attn.wq.weight"].dtype, sharded["attn.wq.weight"].dtype},
            "full": torch.equal(full[0]["attn.wq.weight"], wq),
            "sharded": torch.equal(sharded["attn.wq.weight"].full_tensor(), wq),
            # the test can tell: bf16 holds no copy of these masters
            "bf16 differs": not torch.equal(wq.bfloat16().float(), wq),
            # the pre-hook wrote the live buffer, as under torch; the full dict holds a copy
            "count": (int(full[0]["calls.seen"]), int(model.calls.seen)),
            "copied": full[0]["calls.seen"].data_ptr() != model.calls.seen.data_ptr(),
        }
    return out


def test_hooked_values_are_the_fp32_masters_under_mixed_precision():
    """Under mixed_precision(bf16) a split key's values are the fp32 masters' rows, sharded
    and whole, at every stage: not the bf16 compute copy the forward runs with. A full
    state dict copies the buffer a state-dict pre-hook filled."""
    for stage, seen in run_ranks(2, from_masters)[0].items():
        assert seen == {"plain": True, "dtypes": {torch.float32}, "full": True,
                        "sharded": True, "bf16 differs": True, "count": (3, 3),
                        "copied": True}, stage


# -- set_state_dict: old names, and misfits ----------------------------------------------
def old_names_and_misfits(rank, world):
    model, opt = zerofn_hooked("zero3")
    train(model, opt, hooked_batches(STEPS, world), rank, world)
    msd, osd = zf.get_state_dict(model, opt, full=True)
    legacy = {("norm.weight" if k == "norm.scale" else k): v for k, v in msd.items()}
    fresh, fresh_opt = zerofn_hooked("zero1", seed=7)
    zf.set_state_dict(fresh, fresh_opt, legacy, osd)
    same = max_error((msd, osd), zf.get_state_dict(fresh, fresh_opt, full=True))
    before = zf.get_state_dict(fresh, fresh_opt, full=True)
    lacking = {k: v for k, v in msd.items() if k != "attn.wk.weight"}
    try:
        zf.set_state_dict(fresh, fresh_opt, lacking, osd)
        refused = None
    except ValueError as e:
        refused = str(e)
    untouched = max_error(before, zf.get_state_dict(fresh, fresh_opt, full=True))
    return same, fresh.calls.count, refused, untouched


def test_set_state_dict_takes_an_old_name_and_refuses_a_misfit_on_every_rank():
    """A state dict with the norm's old name loads (its load pre-hook renames it), and
    one lacking ``attn.wk.weight`` is refused on every rank, naming what the merge left
    over, with nothing written."""
    for same, count, refused, untouched in run_ranks(2, old_names_and_misfits):
        assert same == 0.0 and count == STEPS
        assert refused is not None and "attn.wqkv.weight" in refused \
            and "attn.wq.weight" in refused, refused
        assert untouched == 0.0


# -- Hugging Face files ------------------------------------------------------------------
class WholeReads:
    """load_pretrained's safetensors readers, logging the keys read whole (``get_tensor``;
    rows come through ``get_slice``)."""

    def __init__(self):
        self.log, self.real = [], pretrained_load._open

    def __enter__(self):
        pretrained_load._open = lambda file: _Logged(self.real(file), self.log)
        return self.log

    def __exit__(self, *exc):
        pretrained_load._open = self.real


class _Logged:
    def __init__(self, inner, log):
        self.inner, self.log = inner, log

    def __enter__(self):
        self.inner.__enter__()
        return self

    def __exit__(self, *exc):
        return self.inner.__exit__(*exc)

    def keys(self):
        return self.inner.keys()

    def get_slice(self, key):
        return self.inner.get_slice(key)

    def get_tensor(self, key):
        self.log.append(key)
        return self.inner.get_tensor(key)


def pretrained(rank, world, root):
    model, opt = zf.compose(zero(3), zf.offload("cpu"))(*hooked_model())
    train(model, opt, hooked_batches(STEPS, world), rank, world)
    want, _ = zf.get_state_dict(model, opt, full=True)
    directory = zf.save_pretrained(model, os.path.join(root, "hooked"), max_shard_size=4000)
    results = {}
    for name, stage in (("zero1", 1), ("zero3", 3)):
        fresh, fresh_opt = zf.compose(zero(stage))(*hooked_model(seed=7))
        with WholeReads() as whole:
            keys = zf.load_pretrained(fresh, directory)
        got, _ = zf.get_state_dict(fresh, fresh_opt, full=True)
        results[name] = (tuple(keys.missing_keys), tuple(keys.unexpected_keys),
                         max(float((want[k] - got[k]).abs().max()) for k in want),
                         fresh.calls.count, sorted(set(whole)))
    if rank == 0:      # an old file: the norm under its old name, and wk left out
        old = {("norm.weight" if k == "norm.scale" else k): v for k, v in want.items()}
        save_file(old, os.path.join(root, "old.safetensors"))
        save_file({k: v for k, v in want.items() if k != "attn.wk.weight"},
                  os.path.join(root, "lacking.safetensors"))
    dist.barrier()
    fresh, fresh_opt = zf.compose(zero(2))(*hooked_model(seed=7))
    zf.load_pretrained(fresh, os.path.join(root, "old.safetensors"))
    got, _ = zf.get_state_dict(fresh, fresh_opt, full=True)
    results["old name"] = max(float((want[k] - got[k]).abs().max()) for k in want)
    try:
        zf.load_pretrained(fresh, os.path.join(root, "lacking.safetensors"))
        results["lacking"] = None
    except ValueError as e:
        results["lacking"] = str(e)
    return results, sorted(want)


def test_save_and_load_pretrained_through_the_hooks(tmp_path):
    """save_pretrained writes the names the hooks give (a plain model's load_state_dict
    takes the file); load_pretrained merges them back at ZeRO-1 and 3 (reading whole only
    what a hook merges), takes the norm's old name, and refuses a file lacking a split
    part on every rank."""
    for results, keys in run_ranks(2, pretrained, str(tmp_path)):
        for stage in ("zero1", "zero3"):
            # read whole: what the merge hooks take, and the buffer (as every buffer); the
            # norm's scale, behind a load hook that only renames it, is read by rows
            assert results[stage] == ((), (), 0.0, STEPS, sorted(SPLIT_KEYS + ["calls.seen"])), \
                (stage, results[stage])
        assert results["old name"] == 0.0
        assert "attn.wqkv.weight" in results["lacking"] and "attn.wq.weight" in results["lacking"]
    files = sorted(f for f in os.listdir(tmp_path / "hooked") if f.endswith(".safetensors"))
    state = {}
    for f in files:
        state.update(load_file(tmp_path / "hooked" / f))
    assert len(files) > 1 and sorted(state) == keys and set(SPLIT_KEYS) <= set(state)
    plain = HookedLM()
    plain.load_state_dict(state)
    assert plain.calls.count == STEPS


def tiny_mamba(seed: int):
    from transformers import MambaConfig, MambaForCausalLM
    torch.manual_seed(seed)
    return MambaForCausalLM(MambaConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2,
                                        state_size=4))


def mamba_old_names(rank, world, path):
    want = {k: v.clone() for k, v in tiny_mamba(0).state_dict().items()}
    if rank == 0:     # the embedding under its old name, and lm_head left to the tie
        save_file({k.replace("backbone.embeddings.", "backbone.embedding."): v.contiguous()
                   for k, v in want.items() if k != "lm_head.weight"}, path)
    dist.barrier()
    model = tiny_mamba(3)
    model, opt = zero(3)(model, torch.optim.AdamW(model.parameters()))
    with WholeReads() as whole:
        keys = zf.load_pretrained(model, path)
    got, _ = zf.get_state_dict(model, opt, full=True)
    return (keys.missing_keys, keys.unexpected_keys,
            max(float((got[k] - want[k]).abs().max()) for k in want), whole)


@pytest.mark.hf
@pytest.mark.slow(reason="imports transformers in every rank; the default suite covers a "
                         "rename-only load hook read by rows with HookedLM's norm")
def test_a_transformers_rename_hook_loads_by_rows(tmp_path):
    """transformers' MambaModel renames ``embedding.`` to ``embeddings.`` in a load
    pre-hook on the whole backbone: an old file loads, and every tensor is still read by
    rows, none whole."""
    pytest.importorskip("transformers")
    for missing, unexpected, err, whole in run_ranks(2, mamba_old_names,
                                                     str(tmp_path / "old.safetensors")):
        assert (missing, unexpected, err, whole) == ([], [], 0.0, [])
