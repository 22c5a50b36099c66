"""``ZeroStrategy``: zerofn as a strategy of Lightning's ``Trainer``."""
from __future__ import annotations

import contextlib

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn

import zerofn as zf

from ...runtime import finish_collectives_at_exit, is_transformed, runtime_of
from ...state_dict import get_model_state_dict
from . import checkpoints as ckpt
from .options import ZeroOptions, refuse
from .precision import ZeroPrecision
from .strategy import (checked_precision, load, mesh_group, refuse_optimizers, register,
                       save_path, tear_down)


class ZeroStrategy(DDPStrategy):
    """Lightning's ``Trainer`` training through zerofn: ZeRO-1/2/3, offload, mixed
    precision and zerofn's checkpoints, over the plain ``LightningModule``.

    ``Trainer(strategy="zerofn_stage_3")`` (the names mirror Lightning's DeepSpeed ones,
    registered by ``zerofn.integrations.lightning.register_strategies()``) or
    ``Trainer(strategy=ZeroStrategy(stage=3, offload="cpu"))``.

    Args:
        stage: ZeRO stage 1, 2 or 3 (``zf.shard_optimizer``, ``shard_grads``,
            ``shard_params``).
        state_dict_type: ``"sharded"`` (default): checkpoints are zerofn's DCP checkpoint,
            a directory every rank writes its shard to, loadable at any world size and
            stage; ``"full"``: one file rank 0 writes, full weights and optimizer state.
        start_method: ``"popen"`` only (Lightning re-runs the script per device, or
            torchrun starts the processes): a spawned or forked fit would hand the main
            process one rank's shard as the model.
        **options: zerofn's options, each mapped onto its transform option of the same
            name. Offload (``zf.offload``): ``offload`` ("cpu" or "nvme"),
            ``offload_params``, ``nvme_path`` (default: the system's temporary directory),
            ``offload_ratio``, ``state_dtype``, ``master_dtype``, ``overlap_step``,
            ``device_budget``. Sharding: ``device_mesh`` ((replicas, shards) for hybrid
            sharding, or a DeviceMesh or ProcessGroup), ``bucket_size``, ``units``,
            ``init`` (a model built on the meta device), and for ZeRO-3 ``prefetch``,
            ``reshard_after_forward``, ``persist_below``. Precision
            (``zf.mixed_precision``, with ``"bf16-mixed"`` or ``"16-mixed"``):
            ``reduce_dtype``, ``loss_scale``, ``initial_scale_power``,
            ``loss_scale_window``, ``hysteresis``, ``min_loss_scale``. ``tensorboard``:
            True writes zerofn's series (``zf.tensorboard``) into the TensorBoardLogger's
            directory; a directory, or a dict of ``zf.tensorboard`` options (``logdir``,
            ``every``, ...).

    The other arguments (``accelerator``, ``parallel_devices``, ``cluster_environment``,
    ``checkpoint_io``, ``precision_plugin``, ``process_group_backend``, ``timeout``) are
    those of Lightning's ``DDPStrategy``; ``timeout`` is also how long a zerofn collective
    waits for the slowest rank.

    Example:
        >>> from zerofn.integrations.lightning import register_strategies
        >>> register_strategies()
        >>> trainer = L.Trainer(strategy="zerofn_stage_3", precision="bf16-mixed",
        ...                     accumulate_grad_batches=2, gradient_clip_val=1.0)
        >>> trainer.fit(model, ckpt_path="last")
    """

    def __init__(self, stage: int = 3, *, state_dict_type: str = "sharded", accelerator=None,
                 parallel_devices=None, cluster_environment=None, checkpoint_io=None,
                 precision_plugin=None, process_group_backend=None, timeout=default_pg_timeout,
                 start_method: str = "popen", **options):
        self.zero = ZeroOptions.from_kwargs(stage, state_dict_type=state_dict_type, **options)
        refuse(self.zero.launch_problems(start_method))
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin,
                         process_group_backend=process_group_backend, timeout=timeout,
                         start_method=start_method)
        self._group = None
        self._names: list[str] = []      # the optimizer's parameters, in its order

    # -- Lightning's settings -------------------------------------------------------------
    @property
    def precision_plugin(self) -> ZeroPrecision:
        return self._precision_plugin

    @precision_plugin.setter
    def precision_plugin(self, plugin) -> None:
        """Lightning's plugin for the precision flag, as zerofn trains it (checked here, at
        the Trainer's construction: before any process starts)."""
        self._precision_plugin = checked_precision(self, plugin, ZeroPrecision)

    def _configure_launcher(self) -> None:
        """One process needs no launcher (and then runs in a notebook too)."""
        if self.num_processes > 1:
            super()._configure_launcher()

    def setup_environment(self) -> None:
        trainer = self.lightning_module.trainer
        # before the process group forms
        refuse(self.zero.trainer_problems(trainer.gradient_clip_val, self._layer_sync))
        super().setup_environment()
        self._group = mesh_group(self)
        finish_collectives_at_exit()    # the strategy runs the process's distributed life

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True          # zerofn's checkpoints load into the sharded model

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False         # ... with the optimizer's state

    @property
    def handles_gradient_accumulation(self) -> bool:
        return False         # Lightning accumulates, under block_backward_sync (no_sync)

    # -- building the model ---------------------------------------------------------------
    @contextlib.contextmanager
    def tensor_init_context(self, empty_init: bool | None = None):
        """``Trainer.init_module(empty_init=True)`` builds on the meta device; the transform
        then materializes each rank's rows only."""
        with torch.device("meta") if empty_init else self.root_device, \
                self.precision_plugin.tensor_init_context():
            yield

    @contextlib.contextmanager
    def model_sharded_context(self):
        """``LightningModule.configure_model`` builds on the meta device: no rank ever
        holds the whole model (zerofn's meta-device construction, ``init=``)."""
        with torch.device("meta"):
            yield

    def setup(self, trainer) -> None:
        """Apply the transform to the LightningModule and its one optimizer (an evaluation
        gets a stateless one, and no offload)."""
        self.accelerator.setup(trainer)
        model = self.lightning_module
        fitting = trainer.state.fn == TrainerFn.FITTING
        if is_transformed(model):
            if fitting:
                raise RuntimeError("This LightningModule was sharded by an earlier fit with "
                                   "zerofn's strategy; fit a new one, resuming from that "
                                   "fit's checkpoint (ckpt_path=).")
        else:
            model = self.precision_plugin.convert_module(model)
            if not ckpt.on_meta(model):
                model.to(self.root_device)
            if fitting:
                self.setup_optimizers(trainer)
            optimizer = self.optimizers[0] if fitting else ckpt.eval_optimizer(model)
            self._names = ckpt.param_names(model, optimizer)
            logdir = self._tensorboard_dir(trainer) if fitting else None
            self.zero.transform(self.precision_plugin.flag, self._group, logdir,
                                fitting=fitting)(model, optimizer)
        self.model = model
        self.precision_plugin.bind(model)
        self.setup_precision_plugin()

    def setup_optimizers(self, trainer) -> None:
        super().setup_optimizers(trainer)
        refuse_optimizers(len(self.optimizers), "configure_optimizers returning")

    def _tensorboard_dir(self, trainer) -> str | None:
        if not self.zero.tensorboard:
            return None
        logger = next((lg for lg in trainer.loggers if isinstance(lg, TensorBoardLogger)), None)
        return self.zero.tensorboard_dir(None if logger is None else self.broadcast(logger.log_dir))

    def model_to_device(self) -> None:
        """zerofn places the model (its shards on this rank's device, or on the host)."""

    # -- the loop -------------------------------------------------------------------------
    def _step(self, name: str, context: str, *args, **kwargs):
        """Every step method through the module's own call, so zerofn's hooks on the
        LightningModule (the root unit's gather under ZeRO-3) run around it."""
        with getattr(self.precision_plugin, context)():
            return self._forward_redirection(self.model, self.lightning_module, name,
                                             *args, **kwargs)

    def training_step(self, *args, **kwargs):
        return self._step("training_step", "train_step_context", *args, **kwargs)

    def validation_step(self, *args, **kwargs):
        return self._step("validation_step", "val_step_context", *args, **kwargs)

    def test_step(self, *args, **kwargs):
        return self._step("test_step", "test_step_context", *args, **kwargs)

    def predict_step(self, *args, **kwargs):
        return self._step("predict_step", "predict_step_context", *args, **kwargs)

    @contextlib.contextmanager
    def block_backward_sync(self):
        """Lightning's accumulation: zerofn's ``no_sync`` (no reduction until the last
        micro-batch's backward)."""
        with self.model.no_sync():
            yield

    def optimizer_step(self, optimizer, closure, model=None, **kwargs):
        """The step, then zerofn's gradient shards cleared (as DeepSpeed's engine does), so
        the next step starts afresh whichever ``zero_grad`` the loop calls."""
        out = super().optimizer_step(optimizer, closure, model, **kwargs)
        self.model.zero_grad()
        return out

    # -- checkpoints ----------------------------------------------------------------------
    def _optimizer(self):
        return runtime_of(self.model).optimizer

    def lightning_module_state_dict(self) -> dict:
        """The sharded state dict (``Shard(0)`` DTensors over zerofn's own buffers, as
        Lightning's FSDP strategies give theirs: what callbacks such as EMA read); full
        weights, gathered on every rank, when ``state_dict_type="full"``."""
        if self.zero.state_dict_type == "sharded":
            return get_model_state_dict(self.model)
        return ckpt.full_state(self.model, None)[0]

    def optimizer_state(self, optimizer) -> dict:
        if self.zero.state_dict_type == "sharded":
            return {}
        return ckpt.full_state(self.model, self._optimizer())[1]

    def save_checkpoint(self, checkpoint: dict, filepath, storage_options=None) -> None:
        """zerofn's sharded checkpoint at ``filepath`` (a directory, every rank writing its
        shard) with Lightning's entries, or, under ``state_dict_type="full"``, Lightning's
        file written by rank 0."""
        if storage_options is not None:
            raise TypeError("ZeroStrategy.save_checkpoint(storage_options=...): zerofn writes "
                            "its checkpoints itself, not through a CheckpointIO.")
        path, sharded = save_path(self, filepath)
        if not sharded:
            return super().save_checkpoint(checkpoint, path)
        entries = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        ckpt.save_sharded(path, self.model, self._optimizer(), checkpoint["global_step"],
                          ckpt.LIGHTNING_EXTRA, self.broadcast(entries))

    def load_checkpoint(self, checkpoint_path, weights_only=None) -> dict:
        """Load into the sharded model (and, fitting, its optimizer) at any world size and
        stage; return Lightning's entries, which Lightning restores itself."""
        module = self.lightning_module
        if not module.strict_loading:
            refuse(["strict_loading=False: zerofn loads every parameter or none"])
        fitting = module.trainer.state.fn == TrainerFn.FITTING
        optimizer = self._optimizer() if fitting else None
        entries = load(self, checkpoint_path, self.model, optimizer, ckpt.LIGHTNING_EXTRA,
                       _full_states, weights_only)
        if fitting and self.zero.tensorboard:
            zf.set_log_step(self.model, entries["global_step"])
        return entries

    def load_model_state_dict(self, checkpoint, strict: bool = True) -> None:
        """Loaded already, by ``load_checkpoint``."""

    def load_optimizer_state_dict(self, checkpoint) -> None:
        """Loaded already, by ``load_checkpoint``."""

    def teardown(self) -> None:
        """The model stays sharded on its devices (no move to the CPU); zerofn's
        TensorBoard files are flushed."""
        tear_down(self, self.model, self.precision_plugin)

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        """Register ``zerofn_stage_1`` ... ``zerofn_stage_3_offload_nvme``."""
        register(cls, strategy_registry)


def _full_states(entries: dict) -> tuple:
    """Lightning's full file: its model state and its first optimizer's, popped."""
    return entries.pop("state_dict"), (entries.pop("optimizer_states", None) or [None])[0]
