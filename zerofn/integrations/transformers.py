"""zerofn inside Hugging Face's ``Trainer``: ``ZeroTrainer``.

    >>> trainer = ZeroTrainer(model=model, args=TrainingArguments(...), train_dataset=ds,
    ...                       zerofn=zf.compose(zf.shard_params(),
    ...                                         zf.mixed_precision(torch.bfloat16)))
    >>> trainer.train()

Trainer drives the loop; zerofn owns sharding, gradient reduction, precision and state:

- The transform is applied to ``(model, optimizer)`` right after Trainer builds the
  optimizer (``create_optimizer``), so ``optim=`` and ``optimizers=`` work as usual;
  Adam/AdamW step in zerofn's CPU Adam under ``offload``.
- accelerate does not prepare the model (it would wrap it in DDP, which cannot hold
  DTensor parameters): ``_wrap_model`` hands Trainer a thin ``_Unprepared`` module, and
  Trainer prepares only what it gets back as ``self.model``.
- ``torch_compile=True``: accelerate compiles only a model it prepares, so the sharded
  model is compiled in place (``model.compile``, zerofn's hooks outside the graphs).
- Accumulation: accelerate's ``no_sync(model)`` calls the model's ``no_sync()``, zerofn's.
- Clipping and the reported norm come from ``zerofn.clip_grad_norm_``.
- fp16 loss scaling is zerofn's (``mixed_precision(torch.float16)``): every backward
  Trainer runs goes through ``zerofn.scale_loss(model, loss)``, a skipped step does not step the
  LR scheduler, and ``TrainingArguments(fp16=...)`` / ``bf16=`` / ``deepspeed=`` /
  ``fsdp=`` are refused (accelerate's GradScaler and autocast would never see the model).
- ``save_model`` writes Hugging Face's layout through ``zerofn.save_pretrained`` on every
  rank (Trainer's own ``_save`` runs on rank 0 only, where a gather would hang).
- Checkpoints: optimizer, scheduler and the exact fp32 model go to a zerofn (DCP)
  checkpoint in ``checkpoint-N/zerofn``, sharded, at any world size; resuming loads it.
"""
from __future__ import annotations

import contextlib
import os

import torch
import torch.distributed as dist
import transformers
from torch import nn
from transformers.trainer import TRAINING_ARGS_NAME

from .. import checkpoint as zf_checkpoint
from ..state.clip import clip_grad_norm_
from ..state.loss_scale import scale_loss
from ..pretrained import load_pretrained, save_pretrained
from ..runtime import finish_collectives_at_exit, is_transformed, runtime_of
from ..api import Transform

__all__ = ["ZeroTrainer"]

STATE_DIR = "zerofn"          # the zerofn checkpoint inside Trainer's checkpoint-N


class ZeroTrainer(transformers.Trainer):
    """``transformers.Trainer`` training through a zerofn transform.

    Args:
        zerofn: the transform to apply, e.g. ``zf.compose(zf.shard_params(),
            zf.mixed_precision(torch.bfloat16))``; applied when Trainer builds the
            optimizer. Mixed precision belongs here, not in ``TrainingArguments``.
        *args: as for ``transformers.Trainer``.
        **kwargs: as for ``transformers.Trainer``.

    Launch with ``torchrun`` (one process per device); a single process needs no launcher.

    Example:
        >>> trainer = ZeroTrainer(model=model, args=args, train_dataset=ds,
        ...                       zerofn=zf.compose(zf.shard_params()))
        >>> trainer.train(resume_from_checkpoint=True)
    """

    def __init__(self, *args, zerofn: Transform, **kwargs):
        if int(transformers.__version__.split(".")[0]) < 5:
            raise ImportError(f"ZeroTrainer needs transformers 5 or later (found "
                              f"{transformers.__version__}): it overrides hooks 4.x does "
                              "not have. pip install 'transformers>=5' accelerate.")
        if not isinstance(zerofn, Transform):
            raise TypeError(f"ZeroTrainer(zerofn=...) takes a zerofn transform such as "
                            f"zerofn.shard_params(), got {zerofn!r}.")
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        if training_args is not None:
            _check_args(training_args)    # before Trainer sets anything up
        self.zerofn = zerofn
        self._pending_weights = None      # a checkpoint to load once the model is sharded
        self._unprepared = None
        super().__init__(*args, **kwargs)
        if self.args.n_gpu > 1:
            raise ValueError(f"ZeroTrainer runs one process per device, not {self.args.n_gpu} "
                             "GPUs in one: launch with torchrun.")
        finish_collectives_at_exit()    # a front door: the Trainer's collectives too

    # -- the model and the optimizer ----------------------------------------------------
    def create_optimizer(self, model=None):
        """Trainer's optimizer, then the zerofn transform over ``(model, optimizer)``."""
        optimizer = super().create_optimizer(model)
        if not is_transformed(self.model):
            _ensure_process_group(self.args.device)
            self.zerofn(self.model, optimizer)
            optimizer.register_step_post_hook(lambda *_: self._report_skipped_step())
            if self.args.torch_compile:
                self.model.compile(backend=self.args.torch_compile_backend or "inductor",
                                   mode=self.args.torch_compile_mode)
            if self._pending_weights is not None:
                self._load_weights(self._pending_weights)
                self._pending_weights = None
        return optimizer

    def _wrap_model(self, model, training=True, dataloader=None):
        """No DDP: ``_Unprepared`` is not ``self.model``, so accelerate leaves it alone."""
        if self._unprepared is None or self._unprepared.module is not self.model:
            self._unprepared = _Unprepared(self.model)
        return self._unprepared

    def _move_model_to_device(self, model, device):
        """A sharded model is where zerofn put it; a meta-device one is materialized by the
        transform on the rank's device."""
        if is_transformed(model) or any(p.is_meta for p in model.parameters()):
            return
        super()._move_model_to_device(model, device)

    def create_accelerator_and_postprocess(self):
        super().create_accelerator_and_postprocess()
        plain_backward = self.accelerator.backward

        def backward(loss, **kwargs):   # fp16: zerofn's loss scale (identity otherwise)
            scaled = loss if not is_transformed(self.model) \
                else scale_loss(self.model, loss)
            return plain_backward(scaled, **kwargs)

        self.accelerator.backward = backward

    def _report_skipped_step(self):
        """An fp16 overflow skipped zerofn's step: tell Trainer, which then leaves the LR
        scheduler alone (accelerate's optimizer wrapper reports skips this way)."""
        if hasattr(self.optimizer, "_is_overflow"):
            self.optimizer._is_overflow = runtime_of(self.model).step_skipped()

    def _clip_grad_norm(self, model):
        return clip_grad_norm_(self.model, self.args.max_grad_norm)

    def _get_grad_norm(self, model, grad_norm=None):
        return clip_grad_norm_(self.model, float("inf")) if grad_norm is None else grad_norm

    # -- saving ---------------------------------------------------------------------------
    def _save(self, output_dir=None, state_dict=None):
        """On every rank: Hugging Face's layout through ``zerofn.save_pretrained``."""
        if not is_transformed(self.model):      # not sharded yet: Trainer's own save
            return super()._save(output_dir, state_dict)
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        save_pretrained(self.model, output_dir)
        if self.args.should_save:
            tokenizer = self.processing_class
            if tokenizer is None:
                tokenizer = getattr(self.data_collator, "tokenizer", None)
            if tokenizer is not None:
                tokenizer.save_pretrained(output_dir)
            torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))

    def _save_optimizer_and_scheduler(self, output_dir):
        """A sharded zerofn checkpoint (optimizer, scheduler and fp32 model), written by
        every rank, instead of rank 0's ``torch.save`` of one rank's shard."""
        rt = runtime_of(self.model)
        zf_checkpoint.save_checkpoint(os.path.join(output_dir, STATE_DIR), self.model,
                                      rt.optimizer, step=self.state.global_step,
                                      sched=self.lr_scheduler)

    # -- resuming -------------------------------------------------------------------------
    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        """Trainer loads weights before building the optimizer, i.e. before the transform:
        the weights wait until the model is sharded (``create_optimizer``)."""
        if is_transformed(self.model):
            self._load_weights(resume_from_checkpoint)
        else:
            self._pending_weights = resume_from_checkpoint

    def _load_optimizer_and_scheduler(self, checkpoint):
        if checkpoint is None:
            return
        state = os.path.join(checkpoint, STATE_DIR)
        if not os.path.isdir(state):
            raise ValueError(f"{checkpoint} has no {STATE_DIR}/ checkpoint: it was not written "
                             "by ZeroTrainer, so it holds no sharded optimizer state to resume "
                             "from. Load its weights with zerofn.load_pretrained instead.")
        rt = runtime_of(self.model)
        _loaded(zf_checkpoint.load_checkpoint(state, self.model, rt.optimizer,
                                              sched=self.lr_scheduler), state)

    def _load_best_model(self):
        self._load_weights(self.state.best_model_checkpoint)

    def _load_weights(self, checkpoint: str) -> None:
        """The exact fp32 weights from the zerofn checkpoint when there is one (not with
        ``save_only_model``), else the Hugging Face files."""
        state = os.path.join(checkpoint, STATE_DIR)
        if os.path.isdir(state):
            _loaded(zf_checkpoint.load_checkpoint(state, self.model), state)
        else:
            load_pretrained(self.model, checkpoint)


class _Unprepared(nn.Module):
    """What Trainer runs: the model, behind an object that is not ``Trainer.model``."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def no_sync(self):
        return self.module.no_sync() if is_transformed(self.module) else contextlib.nullcontext()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Trainer zeroes gradients through the model: a transformed one's ``zero_grad``
        resets zerofn's gradient shards too."""
        self.module.zero_grad(set_to_none)

    def _get_name(self):
        """Trainer's label smoothing picks its loss by the model's class name."""
        return self.module._get_name()


def _check_args(args) -> None:
    refused = {
        "fp16": "use zerofn.mixed_precision(torch.float16) in zerofn=",
        "bf16": "use zerofn.mixed_precision(torch.bfloat16) in zerofn=",
        "deepspeed": "zerofn is the ZeRO implementation here; drop deepspeed=",
        "fsdp": "zerofn shards the model; drop fsdp=",
    }
    bad = [f"{name}={getattr(args, name)!r} ({why})" for name, why in refused.items()
           if getattr(args, name, None)]
    if bad:
        raise ValueError("ZeroTrainer cannot use TrainingArguments " + "; ".join(bad) + ".")


def _ensure_process_group(device: torch.device) -> None:
    """A run without a launcher is one process: give it a one-rank group (accelerate
    creates the group itself under torchrun)."""
    if dist.is_initialized():
        return
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise RuntimeError("WORLD_SIZE > 1 but no process group: launch with torchrun.")
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


def _loaded(result, state: str):
    """``load_checkpoint`` finds nothing in a directory an unfinished save left behind."""
    if result is None:
        raise FileNotFoundError(f"{state} holds no complete zerofn checkpoint (an unfinished "
                                "save?); resume from another checkpoint-N.")
    return result
