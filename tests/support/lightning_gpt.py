"""A LightningModule for the Lightning tests: zerofn's small GPT on its built-in corpus, the
windows it trains on, and what a run records (losses, learning rates, full weights).

Every run reads the same windows in the same order for a given global batch, whatever the
world size: Lightning's DistributedSampler deals each rank every world-th window of one
permutation, so a rank's micro-batch of ``GLOBAL_BATCH / world`` windows holds its share
of the same global micro-batch.
"""
from __future__ import annotations

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

import zerofn as zf
from zerofn.data import load_corpus, split
from zerofn.nanogpt import GPT, GPTConfig
from zerofn.runtime import runtime_of

CONFIG = dict(vocab=256, width=48, heads=2, ffn=96, layers=2, context=24)
GLOBAL_BATCH = 4              # windows per micro-batch, over all ranks
ACCUMULATE = 2                # micro-batches per optimizer step
STEPS_PER_EPOCH = 10          # optimizer steps
LR = 1e-3                     # (see support/models.py: Adam at 1e-2 moves parity by 5e-5)


VAL_WINDOWS = 8


class Windows(Dataset):
    """Fixed windows of the corpus's training part (or its held-out part): inputs, and the
    same bytes shifted by one."""

    def __init__(self, count: int, context: int = CONFIG["context"], held_out: bool = False):
        corpus = split(load_corpus())[1 if held_out else 0]
        stride = (len(corpus) - context - 1) // count
        self.windows = torch.stack([corpus[i * stride:i * stride + context + 1]
                                    for i in range(count)]).long()

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, i):
        return self.windows[i, :-1], self.windows[i, 1:]


class LitGPT(L.LightningModule):
    """The GPT, AdamW with a linear warm-up per optimizer step, the loss logged.

    ``meta``: the GPT is built in ``configure_model`` (under zerofn's strategy, on the meta
    device; the strategy's ``init=`` then initializes it)."""

    def __init__(self, world: int = 2, meta: bool = False, config: dict | None = None):
        super().__init__()
        self.save_hyperparameters()
        self.cfg = GPTConfig(**(config or CONFIG))
        self.model = None if meta else GPT(self.cfg)

    def configure_model(self) -> None:
        if self.model is None:
            self.model = GPT(self.cfg)

    def forward(self, x, y):
        return self.model(x, y)

    def training_step(self, batch, batch_idx):
        loss = self(*batch)
        self.log("loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self(*batch), sync_dist=True)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=LR, weight_decay=0.1)
        warmup = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / 8))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": warmup, "interval": "step"}}

    def train_dataloader(self):
        count = STEPS_PER_EPOCH * ACCUMULATE * GLOBAL_BATCH
        return DataLoader(Windows(count, self.cfg.context),
                          batch_size=GLOBAL_BATCH // self.hparams.world,
                          shuffle=True)

    def val_dataloader(self):
        return DataLoader(Windows(VAL_WINDOWS, self.cfg.context, held_out=True),
                          batch_size=GLOBAL_BATCH // self.hparams.world)


class ManualGPT(LitGPT):
    """The same, optimized by hand: a step per micro-batch, zero_grad through Lightning's
    optimizer wrapper (torch's own zero_grad, which leaves zerofn's shards to the step)."""

    def __init__(self, world: int = 2):
        super().__init__(world=world)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        loss = self(*batch)
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        self.lr_schedulers().step()
        return loss


class Record(L.Callback):
    """Each micro-batch's mean loss and each optimizer step's learning rate; where
    Lightning's counters, the LR scheduler and zerofn's loss scale stood at the start."""

    def __init__(self):
        self.losses, self.lrs, self.start = [], [], {}

    def on_train_start(self, trainer, module):
        scheduler = trainer.lr_scheduler_configs[0].scheduler
        self.start = dict(global_step=trainer.global_step, epoch=trainer.current_epoch,
                          scheduler_step=scheduler.last_epoch, lr=scheduler.get_last_lr()[0])
        if zf.is_transformed(module):
            self.start["loss_scale"] = runtime_of(module).loss_scale()

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        """The micro-batch's loss over every rank's share (comparable across world sizes)."""
        self.losses.append(float(trainer.strategy.reduce(outputs["loss"].detach().float())))

    def on_before_optimizer_step(self, trainer, module, optimizer):
        self.lrs.append(optimizer.param_groups[0]["lr"])


def full_weights(module: torch.nn.Module) -> dict:
    """The module's weights as full fp32 tensors on the CPU, sharded by zerofn or not (call
    on every rank)."""
    if zf.is_transformed(module):
        from zerofn.state_dict import get_model_state_dict
        state = get_model_state_dict(module, full=True, device="cpu")
    else:
        state = module.state_dict()
    return {k: v.detach().float().cpu().clone() for k, v in state.items()}
