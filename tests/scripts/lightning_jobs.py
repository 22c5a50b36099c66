"""Lightning runs for tests/test_lightning.py, each writing what it measured to OUT.

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/scripts/lightning_jobs.py two OUT [--every-name]
    python tests/scripts/lightning_jobs.py one OUT        (one process: devices=1; after ``two``)
    python tests/scripts/lightning_jobs.py figures OUT    (prints what they measured)

``two``, on two ranks: the Trainer and Fabric under DDP and under zerofn's registered
names (Fabric under two of them, or all with ``--every-name``); a run stopped at step 10
and resumed at another stage, against one not stopped, from a sharded and a full-file
checkpoint; a model built on the meta device; bf16 and fp16; TensorBoard; what zerofn
refuses; and last, clipping by value. ``one``: the stopped run's checkpoint resumed on one
device at stage 1. One launch each: starting the processes (importing torch and
Lightning) is most of their time. Rank 0 saves each run's record as ``OUT/<run>.pt``.
"""
from __future__ import annotations

import os
import sys
import warnings

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.plugins.precision import MixedPrecision

import zerofn as zf
import zerofn.integrations.lightning as zl
from support.lightning_gpt import (ACCUMULATE, CONFIG, GLOBAL_BATCH, LR, STEPS_PER_EPOCH,
                                   LitGPT, ManualGPT, Record, Windows, full_weights)
from support.memory import reset_peak, status_bytes
from zerofn.nanogpt import GPT, GPTConfig, init_weights
from zerofn.runtime import runtime_of

zl.register_strategies()      # the zerofn_stage_* names the jobs train under
STEPS = 2 * STEPS_PER_EPOCH
QUIET = dict(accelerator="cpu", logger=False, enable_progress_bar=False,
             enable_model_summary=False)
NO_VALIDATION = dict(limit_val_batches=0, num_sanity_val_steps=0)


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def save(out: str, name: str, record: dict) -> None:
    if rank() == 0:
        torch.save(record, os.path.join(out, f"{name}.pt"))


def fit(strategy, out: str, name: str, devices: int = 2, ckpt_path=None, callbacks=(),
        make=LitGPT, weights: bool = True, **trainer) -> tuple[L.Trainer, dict]:
    """Fit ``make(world=devices)`` (seed 0): 2 epochs of 10 steps, 2 micro-batches each,
    clipped at norm 1; save and return its record (losses, learning rates, final weights,
    and where Lightning's counters stood when training started)."""
    L.seed_everything(0, verbose=False)
    module = make(world=devices)
    record = Record()
    settings = dict(devices=devices, strategy=strategy, max_epochs=2,
                    accumulate_grad_batches=ACCUMULATE, gradient_clip_val=1.0,
                    callbacks=[record, *callbacks], enable_checkpointing=bool(callbacks),
                    default_root_dir=out, **QUIET, **NO_VALIDATION)
    trainer_ = L.Trainer(**{**settings, **trainer})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer_.fit(module, ckpt_path=ckpt_path)
    state = trainer_.strategy.lightning_module_state_dict()
    result = dict(losses=record.losses, lrs=record.lrs, start=record.start,
                  weights=full_weights(trainer_.lightning_module) if weights else None,
                  global_step=trainer_.global_step, epoch=trainer_.current_epoch,
                  overridden=sum("has been overridden" in str(w.message) for w in caught),
                  module_state={k: type(v).__name__ for k, v in state.items()})
    save(out, name, result)
    return trainer_, result


# -- parity ------------------------------------------------------------------------------
def fabric_run(strategy, out: str, name: str) -> None:
    """The same training as ``fit`` in a Fabric loop of one's own."""
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    L.seed_everything(0, verbose=False)
    model = GPT(GPTConfig(**CONFIG))
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    model, opt = fabric.setup(model, opt)
    loader = fabric.setup_dataloaders(torch.utils.data.DataLoader(
        Windows(STEPS_PER_EPOCH * ACCUMULATE * GLOBAL_BATCH), batch_size=GLOBAL_BATCH // 2,
        shuffle=True))
    losses = []
    for epoch in range(2):
        loader.sampler.set_epoch(epoch)
        for i, (x, y) in enumerate(loader):
            boundary = i % ACCUMULATE == ACCUMULATE - 1
            with fabric.no_backward_sync(model, enabled=not boundary):
                loss = model(x, y)
                fabric.backward(loss / ACCUMULATE)
            losses.append(float(loss))
            if boundary:
                fabric.clip_gradients(model, opt, max_norm=1.0)
                opt.step()
                opt.zero_grad()
    save(out, name, dict(losses=losses, weights=full_weights(model.module)))
    if strategy == "zerofn_stage_3":
        fabric.save(f"{out}/fabric-ckpt", {"model": model, "optimizer": opt, "step": 20})


def fabric_setup(strategy, optimizer: bool = True):
    """A fresh GPT (seed 1, unlike the trained one) set up by a new Fabric."""
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    L.seed_everything(1, verbose=False)
    model = GPT(GPTConfig(**CONFIG))
    if not optimizer:
        return fabric, fabric.setup(model), None
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    return (fabric, *fabric.setup(model, opt))


def fabric_checkpoints(out: str) -> None:
    """ZeRO-3's sharded Fabric checkpoint into a model set up alone at ZeRO-2, and into a
    model and optimizer at ZeRO-1, which saves it as one full file; that file into ZeRO-3."""
    fabric, model, _ = fabric_setup("zerofn_stage_2", optimizer=False)
    state = {"model": model, "step": 0}
    fabric.load(f"{out}/fabric-ckpt", state)
    alone = dict(weights=full_weights(model.module), step=state["step"])
    fabric, model, opt = fabric_setup(zl.ZeroFabricStrategy(stage=1, state_dict_type="full"))
    fabric.load(f"{out}/fabric-ckpt", {"model": model, "optimizer": opt})
    moments = zf.get_state_dict(model.module, opt.optimizer, full=True)[1]["state"]
    by_name = sorted(opt.state_dict()["state"]) == sorted(moments)   # Fabric's wrapper's
    fabric.save(f"{out}/fabric-full.ckpt", {"model": model, "optimizer": opt, "step": 20})
    fabric, model, opt = fabric_setup("zerofn_stage_3")
    state = {"model": model, "optimizer": opt, "step": 0}
    fabric.load(f"{out}/fabric-full.ckpt", state)
    again = zf.get_state_dict(model.module, opt.optimizer, full=True)[1]["state"]
    gap = max((again[n][k] - v).abs().max().item() for n, s in moments.items()
              for k, v in s.items() if v.dim())
    save(out, "fabric-checkpoints", dict(alone=alone, full=full_weights(model.module),
                                         step=state["step"], moment_gap=gap, by_name=by_name))


FABRIC_NAMES = ("zerofn_stage_2_offload", "zerofn_stage_3")     # without --every-name


def parity(out: str, every_name: bool) -> None:
    fit("ddp", out, "trainer-ddp", callbacks=[every_epoch(f"{out}/ddp-ckpt")])
    for name in zl.STRATEGY_NAMES:
        fit(name, out, f"trainer-{name}")
    fit("ddp", out, "trainer-ddp-unclipped", gradient_clip_val=None)   # clipping matters
    fit(zl.ZeroStrategy(stage=3, device_mesh=(2, 1)), out, "trainer-hsdp")
    for name in ("ddp", "zerofn_stage_2"):
        fit(name, out, f"manual-{name}", make=ManualGPT, max_epochs=1,
            accumulate_grad_batches=1, gradient_clip_val=None)
    for name in ("ddp", *(zl.STRATEGY_NAMES if every_name else FABRIC_NAMES)):
        fabric_run(name, out, f"fabric-{name}")
    fabric_checkpoints(out)


def clip_value(out: str) -> None:
    """torch's clip by value, under DDP and zerofn. Until p.grad shows the reduced
    gradients (issue 32), zerofn's raises (torch finds no gradient): recorded, on every
    rank alike, as the run's error."""
    for name in ("ddp", "zerofn_stage_2"):
        try:
            fit(name, out, f"value-{name}", gradient_clip_val=1e-3,
                gradient_clip_algorithm="value")
        except RuntimeError as e:
            save(out, f"value-{name}", dict(error=str(e)))


# -- resuming ----------------------------------------------------------------------------
def every_epoch(dirpath: str) -> ModelCheckpoint:
    return ModelCheckpoint(dirpath=dirpath, every_n_epochs=1, save_top_k=-1,
                           save_on_train_epoch_end=True)


STRAIGHT = "trainer-zerofn_stage_3"     # ZeRO-3's 20 steps, not stopped: what resumes follow


def resume(out: str) -> None:
    """Stage 3: 10 steps and stop (ModelCheckpoint); resumed at stage 2. The 20 steps
    straight that resumed runs are held to are parity's ``trainer-zerofn_stage_3`` (the
    same fit: a second one would cost a run and show nothing more)."""
    fit("zerofn_stage_3", out, "stopped", callbacks=[every_epoch(f"{out}/ckpt")], max_epochs=1)
    evaluator = L.Trainer(devices=2, strategy="zerofn_stage_3", default_root_dir=out, **QUIET)
    metrics = evaluator.validate(LitGPT(world=2), ckpt_path=f"{out}/ckpt/epoch=0-step=10.ckpt",
                                 verbose=False)
    save(out, "validated", metrics[0])
    fit("zerofn_stage_2", out, "resumed-world2-stage2", ckpt_path=f"{out}/ckpt/epoch=0-step=10.ckpt")
    # DDP's own checkpoint file (optimizer state keyed by index) resumed under ZeRO-3
    fit("zerofn_stage_3", out, "resumed-from-ddp", ckpt_path=f"{out}/ddp-ckpt/epoch=0-step=10.ckpt")
    # the same checkpoint as one full file: saved by rank 0, resumed sharded at stage 1
    full, _ = fit(zl.ZeroStrategy(stage=3, state_dict_type="full"), out, "stopped-full",
                  max_epochs=1)
    full.save_checkpoint(f"{out}/full.ckpt")
    fit("zerofn_stage_1", out, "resumed-full-stage1", ckpt_path=f"{out}/full.ckpt")


def one(out: str) -> None:
    fit("zerofn_stage_1", out, "resumed-world1-stage1", devices=1,
        ckpt_path=f"{out}/ckpt/epoch=0-step=10.ckpt")


# -- the rest ----------------------------------------------------------------------------
class SetupPeak(L.Callback):
    """How far resident memory rises from the fit's set-up (before configure_model) to
    its start (the model sharded, materialized and its optimizer built)."""

    def setup(self, trainer, module, stage):
        reset_peak()
        self.before = status_bytes("VmRSS")

    def on_fit_start(self, trainer, module):
        self.rise = status_bytes("VmHWM") - self.before


def meta_setup(out: str) -> None:
    config = dict(vocab=256, width=768, heads=8, ffn=3072, layers=8, context=16)
    peak = SetupPeak()
    strategy = zl.ZeroStrategy(stage=3, init=init_weights)
    trainer, _ = fit(strategy, out, "meta",
                     make=lambda world: LitGPT(world=world, meta=True, config=config),
                     callbacks=[peak], weights=False, max_epochs=None, max_steps=1,
                     enable_checkpointing=False, limit_train_batches=1,
                     accumulate_grad_batches=1)
    rt = runtime_of(trainer.lightning_module)
    rises = [None, None]
    dist.all_gather_object(rises, peak.rise)
    save(out, "meta-peak", dict(rises=rises, full=GPTConfig(**config).params() * 4,
                                share=sum(u.shard_numel * 4 for u in rt.units),
                                largest=max(u.shard_numel * 2 * 4 for u in rt.units)))


def precisions(out: str) -> None:
    fit("zerofn_stage_2", out, "bf16-mixed", precision="bf16-mixed", max_epochs=1)
    fit("zerofn_stage_3", out, "bf16-true", precision="bf16-true", weights=False, max_epochs=1)
    # Lightning turns "16-mixed" on the CPU into "bf16-mixed"; its plugin keeps fp16.
    trainer, _ = fit("zerofn_stage_3", out, "16-mixed", max_epochs=1,
                     plugins=[MixedPrecision("16-mixed", "cpu")])
    scale = runtime_of(trainer.lightning_module).loss_scale()
    trainer.save_checkpoint(f"{out}/fp16.ckpt")
    _, resumed = fit("zerofn_stage_3", out, "16-mixed-resumed", ckpt_path=f"{out}/fp16.ckpt",
                     plugins=[MixedPrecision("16-mixed", "cpu")], max_epochs=None,
                     max_steps=STEPS_PER_EPOCH + 1)
    save(out, "fp16-scale", dict(saved=scale, resumed=resumed["start"]["loss_scale"]))


def tensorboard(out: str) -> None:
    """zerofn's series in the TensorBoardLogger's directory: 10 steps, then 10 more
    resumed from the checkpoint into the same directory."""
    def logged(**settings):
        logger = TensorBoardLogger(f"{out}/tb", name="gpt", version=0)
        fit(zl.ZeroStrategy(stage=3, tensorboard={"every": 2}), out, "tensorboard",
            logger=logger, log_every_n_steps=1, weights=False, **settings)
        return logger.log_dir
    logged(max_epochs=1, callbacks=[every_epoch(f"{out}/tb-ckpt")])
    log_dir = logged(ckpt_path=f"{out}/tb-ckpt/epoch=0-step=10.ckpt")
    save(out, "tensorboard-dir", dict(log_dir=log_dir))


class TwoOptimizers(LitGPT):
    def __init__(self, world: int):
        super().__init__(world=world)
        self.automatic_optimization = False

    def configure_optimizers(self):
        half = len(list(self.parameters())) // 2
        params = list(self.parameters())
        return torch.optim.SGD(params[:half], lr=LR), torch.optim.SGD(params[half:], lr=LR)


class Lenient(LitGPT):
    strict_loading = False


def refusals(out: str) -> None:
    """What zerofn cannot honour, each refused on every rank; the job going on to the next
    shows that no rank was left in a collective."""
    attempts = {
        "precision": lambda: L.Trainer(devices=2, strategy="zerofn_stage_3",
                                       precision="16-true", **QUIET),
        "gradient_clip_val": lambda: fit(zl.ZeroStrategy(stage=2, offload="cpu",
                                                         overlap_step=True), out, "never"),
        "configure_optimizers": lambda: fit("zerofn_stage_2", out, "never",
                                            make=TwoOptimizers, gradient_clip_val=None,
                                            accumulate_grad_batches=1),
        "sync_batchnorm": lambda: fit("zerofn_stage_2", out, "never", sync_batchnorm=True),
        "strict_loading": lambda: fit("zerofn_stage_2", out, "never", make=Lenient,
                                      ckpt_path=f"{out}/ckpt/epoch=0-step=10.ckpt"),
    }
    messages = {}
    for option, attempt in attempts.items():
        try:
            attempt()
            messages[option] = None
        except ValueError as e:
            messages[option] = str(e)
    gathered = [None, None]
    dist.all_gather_object(gathered, messages)
    save(out, "refusals", dict(by_rank=gathered))


def two(out: str, every_name: bool) -> None:
    parity(out, every_name)
    resume(out)
    meta_setup(out)
    precisions(out)
    tensorboard(out)
    refusals(out)
    clip_value(out)


def figures(out: str) -> None:
    """What the runs in OUT measured, as the closing note quotes it (after ``two``, ``one``)."""
    def load(name):
        path = os.path.join(out, f"{name}.pt")
        return torch.load(path, weights_only=False) if os.path.exists(path) else None

    def gaps(run, ref, skip=0):
        w = max((run["weights"][k] - v).abs().max().item() for k, v in ref["weights"].items())
        loss = max(abs(a - b) for a, b in zip(run["losses"], ref["losses"][skip:]))
        return f"weights {w:.1e}, losses {loss:.1e}"

    pairs = [(f"trainer-{n}", "trainer-ddp", 0) for n in zl.STRATEGY_NAMES]
    pairs += [("trainer-hsdp", "trainer-ddp", 0), ("manual-zerofn_stage_2", "manual-ddp", 0)]
    pairs += [(f"fabric-{n}", "fabric-ddp", 0) for n in zl.STRATEGY_NAMES]
    pairs += [(n, STRAIGHT, 20) for n in ("resumed-world2-stage2", "resumed-full-stage1",
                                            "resumed-world1-stage1")]
    pairs += [("resumed-from-ddp", "trainer-ddp", 20)]
    for name, ref, skip in pairs:
        if load(name) is not None:
            print(f"{name:36} against {ref:12} {gaps(load(name), load(ref), skip)}")
    peak = load("meta-peak")
    mib = 2 ** 20
    print(f"meta set-up: rise {[round(r / mib) for r in peak['rises']]} MiB per rank; model "
          f"{peak['full'] / mib:.0f} MiB, a rank's share {peak['share'] / mib:.0f} MiB, "
          f"largest unit {peak['largest'] / mib:.0f} MiB")
    for flag in ("bf16-mixed", "16-mixed", "bf16-true"):
        losses = load(flag)["losses"]
        print(f"{flag:10} loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    print("fp16 loss scale saved / resumed:", load("fp16-scale"))


if __name__ == "__main__":
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    torch.set_num_threads(1)
    {"two": lambda out: two(out, "--every-name" in sys.argv[3:]), "one": one,
     "figures": figures}[sys.argv[1]](sys.argv[2])
