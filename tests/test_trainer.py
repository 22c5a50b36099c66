"""ZeroTrainer: transformers.Trainer through a zerofn transform.

ZeRO-3 on 2 gloo ranks follows a single-process Trainer on the same global batches (loss
per step, gradient norms, final weights, evaluation loss), with accumulation, clipping, a
decaying learning rate and activation checkpointing; resuming from its checkpoint (into
a model built on the meta device) continues exactly like the uninterrupted run; fp16 loss scaling is zerofn's, and a
skipped step leaves the LR scheduler alone; torch_compile=True compiles the sharded model.
"""
from __future__ import annotations

import contextlib
import os
import warnings

import pytest
import torch
import torch._dynamo

import zerofn as zf
from support.compare import TOL
from support.ranks import run_ranks

transformers = pytest.importorskip("transformers")
from support.hf_models import build  # noqa: E402 (needs transformers)
from zerofn.integrations.transformers import ZeroTrainer  # noqa: E402 (needs transformers)

pytestmark = pytest.mark.hf

ROWS, SEQ, VOCAB = 24, 10, 97     # ids fit both test models
STEPS, SAVE_AT = 6, 3
ACCUM = 2
GLOBAL_ROWS = 8          # per optimizer step: 2 micro-batches of 4 rows
CLIP = 0.5


class Rows(torch.utils.data.Dataset):
    """Token rows whose labels ignore a different number of trailing tokens per row, so
    micro-batches hold different numbers of predicted tokens. ``whole``: every token is
    predicted (Trainer's evaluation loss is a mean of batch means at one rank and a token
    mean at several; equal batches make them the same)."""

    def __init__(self, whole: bool = False):
        g = torch.Generator().manual_seed(4)
        self.ids = torch.randint(3, VOCAB, (ROWS, SEQ), generator=g)
        self.keep = torch.randint(5, SEQ + 1, (ROWS,), generator=g)
        if whole:
            self.keep.fill_(SEQ)

    def __len__(self):
        return ROWS

    def __getitem__(self, i):
        labels = self.ids[i].clone()
        labels[self.keep[i]:] = -100
        return {"input_ids": self.ids[i], "labels": labels}


def arguments(out: str, world: int, **kw):
    """The same global batches at any world size; a linearly decaying learning rate."""
    return transformers.TrainingArguments(**{
        "output_dir": out, "per_device_train_batch_size": GLOBAL_ROWS // ACCUM // world,
        "gradient_accumulation_steps": ACCUM, "max_steps": STEPS, "learning_rate": 1e-3,
        "weight_decay": 0.1, "max_grad_norm": CLIP, "logging_steps": 1,
        "train_sampling_strategy": "sequential", "save_strategy": "no", "report_to": [],
        "use_cpu": True, "seed": 0, "disable_tqdm": True, "dataloader_num_workers": 0,
        "per_device_eval_batch_size": ROWS // 2, **kw})   # the same 2 eval batches anywhere


def launched_like_torchrun(rank: int, world: int) -> None:
    """accelerate reads the launcher's environment (the harness made the group already)."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), OMP_NUM_THREADS="1")


def history(trainer, key: str) -> dict:
    return {e["step"]: e[key] for e in trainer.state.log_history if key in e}


def plain_trainer(rank, world, out):
    model = build("llama")
    trainer = transformers.Trainer(model=model, args=arguments(out, world), train_dataset=Rows(),
                                   eval_dataset=Rows(whole=True))
    trainer.train()
    return history(trainer, "loss"), history(trainer, "grad_norm"), \
        {k: v.numpy() for k, v in model.state_dict().items()}, trainer.evaluate()["eval_loss"]


def zero_run(rank, world, out, resume=None, meta=False):
    """ZeRO-3 through ZeroTrainer; ``meta``: the model is built on the meta device and
    materialized by the transform (with transformers' own init), its weights then coming
    from the checkpoint resumed."""
    with torch.device("meta") if meta else contextlib.nullcontext():
        model = build("llama")
    save = dict(save_strategy="steps", save_steps=SAVE_AT) if resume is None else {}
    init = {"init": model._init_weights} if meta else {}
    trainer = ZeroTrainer(
        model=model, args=arguments(out, world, **save), train_dataset=Rows(),
        eval_dataset=Rows(whole=True),
        zerofn=zf.compose(zf.shard_optimizer(**init), zf.shard_grads(), zf.shard_params()))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train(resume_from_checkpoint=resume)
    trainer.overridden = sum("has been overridden" in str(w.message) for w in caught)
    opt = zf.runtime.runtime.runtime_of(model).optimizer
    weights, _ = zf.get_state_dict(model, opt, full=True)
    return trainer, {k: v.numpy() for k, v in weights.items()}


def zero_trainer(rank, world, root):
    launched_like_torchrun(rank, world)
    first, weights = zero_run(rank, world, os.path.join(root, "first"))
    first.save_model(os.path.join(root, "final"))
    eval_loss = first.evaluate()["eval_loss"]       # ZeRO-3 forwards in lockstep
    checkpoint = os.path.join(root, "first", f"checkpoint-{SAVE_AT}")
    resumed, resumed_weights = zero_run(rank, world, os.path.join(root, "resumed"),
                                        resume=checkpoint, meta=True)
    return dict(loss=history(first, "loss"), grad_norm=history(first, "grad_norm"),
                weights=weights, resumed_loss=history(resumed, "loss"),
                resumed_weights=resumed_weights, checkpoint=sorted(os.listdir(checkpoint)),
                lr_steps=resumed.lr_scheduler.last_epoch, eval_loss=eval_loss,
                overridden=first.overridden + resumed.overridden)


@pytest.mark.multirank
def test_zero3_trainer_follows_trainer_and_resumes_exactly(tmp_path):
    losses, norms, want, eval_loss = run_ranks(1, plain_trainer, str(tmp_path / "plain"))[0]
    results = run_ranks(2, zero_trainer, str(tmp_path), timeout=400)
    assert results[0]["loss"] == results[1]["loss"]      # Trainer logs the mean over ranks
    r = results[0]
    assert sorted(losses) == sorted(r["loss"]) == list(range(1, STEPS + 1))
    for step in losses:
        assert abs(losses[step] - r["loss"][step]) < TOL, (step, losses[step], r["loss"][step])
        assert abs(norms[step] - r["grad_norm"][step]) < TOL * norms[step], step
    assert min(norms.values()) > CLIP                     # clipping really clipped
    assert abs(r["eval_loss"] - eval_loss) < TOL, (r["eval_loss"], eval_loss)
    for k, v in want.items():
        err = abs(torch.from_numpy(r["weights"][k]) - torch.from_numpy(v)).max().item()
        assert err < TOL, (k, err)
    # resuming at step 3, into a model built on the meta device, continues exactly as the
    # uninterrupted run did
    for step in range(SAVE_AT + 1, STEPS + 1):
        assert r["resumed_loss"][step] == r["loss"][step], step
    for k, v in r["weights"].items():
        assert (r["resumed_weights"][k] == v).all(), k
    assert r["lr_steps"] == STEPS
    assert r["overridden"] == 0     # torch's LR scheduler finds torch's own step()
    # Trainer's checkpoint: Hugging Face weights, a sharded zerofn checkpoint, no
    # rank-0 torch.save of the optimizer
    assert {"model.safetensors", "config.json", "zerofn", "trainer_state.json",
            "rng_state_0.pth", "rng_state_1.pth"} <= set(r["checkpoint"]), r["checkpoint"]
    assert "optimizer.pt" not in r["checkpoint"]
    final = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "final"))
    for k, v in final.state_dict().items():
        assert torch.equal(v, torch.from_numpy(r["weights"][k])), k
    assert os.path.exists(tmp_path / "final" / "training_args.bin")


def fp16_offload(rank, world, out):
    """fp16 from 2**20 with hysteresis 1: the first steps overflow and are skipped (the LR
    scheduler with them), the scale halves each time, then training goes on; AdamW from
    Trainer steps in zerofn's CPU Adam."""
    model = build("gpt2")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = ZeroTrainer(
        model=model, args=arguments(out, world, max_steps=8), train_dataset=Rows(),
        zerofn=zf.compose(zf.shard_grads(), zf.offload("cpu"),
                          zf.mixed_precision(torch.float16, initial_scale_power=20,
                                             hysteresis=1)))
    trainer.train()
    rt = zf.runtime.runtime.runtime_of(model)
    weights, _ = zf.get_state_dict(model, rt.optimizer, full=True)
    moved = any(not torch.equal(weights[k], v) for k, v in before.items())
    return (rt.scaler.scale, trainer.lr_scheduler.last_epoch, trainer.state.global_step,
            rt.homes.cpu_adam and rt.homes.decoupled, moved)


@pytest.mark.multirank
def test_fp16_loss_scaling_is_zerofns(tmp_path):
    scale, lr_steps, steps, cpu_adamw, moved = run_ranks(1, fp16_offload, str(tmp_path))[0]
    skipped = steps - lr_steps
    assert steps == 8 and 0 < skipped < steps, (steps, lr_steps)
    assert scale == 2.0 ** (20 - skipped), (scale, skipped)
    assert cpu_adamw is True and moved


def compiled_trainer(rank, world, root):
    """ZeroTrainer (ZeRO-3) with and without torch_compile=True: per-step losses, and
    the graphs dynamo compiled."""
    launched_like_torchrun(rank, world)
    out = []
    for compiled in (False, True):
        torch._dynamo.reset()
        extra = dict(torch_compile=True, torch_compile_backend="aot_eager") if compiled else {}
        trainer = ZeroTrainer(
            model=build("llama"), args=arguments(os.path.join(root, str(compiled)), world,
                                                 **extra),
            train_dataset=Rows(),
            zerofn=zf.compose(zf.shard_optimizer(), zf.shard_grads(), zf.shard_params()))
        trainer.train()
        out.append((history(trainer, "loss"),
                    torch._dynamo.utils.counters["stats"]["unique_graphs"]))
    return out


@pytest.mark.multirank
def test_torch_compile_is_honoured_and_trains_as_uncompiled(tmp_path):
    """Trainer's torch_compile=True compiles the sharded model (accelerate compiles only a
    model it prepares, which ZeroTrainer's is not)."""
    for (eager, _), (compiled, graphs) in run_ranks(2, compiled_trainer, str(tmp_path),
                                                    timeout=300):
        assert graphs > 0 and compiled == eager, (graphs, eager, compiled)


def test_refuses_what_would_bypass_zerofn(tmp_path):
    model = build("gpt2")
    args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[],
                                          bf16=True)
    with pytest.raises(ValueError, match="mixed_precision"):
        ZeroTrainer(model=model, args=args,
                                                 zerofn=zf.shard_params())
    with pytest.raises(TypeError, match="zerofn transform"):
        ZeroTrainer(model=model, args=args, zerofn="zero3")


def test_core_package_does_not_import_transformers():
    from support.imports import loaded_by_zerofn
    assert not {"transformers", "accelerate"} & loaded_by_zerofn()
