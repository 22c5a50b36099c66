"""``ZeroFabricStrategy``: zerofn as a strategy of Lightning's ``Fabric``."""
from __future__ import annotations

import contextlib

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import DDPStrategy
from lightning.fabric.strategies.strategy import (_BackwardSyncControl, _Sharded,
                                                  _validate_keys_for_strict_loading)
from lightning.fabric.utilities.types import _Stateful
from torch import nn

import zerofn as zf

from ...runtime import finish_collectives_at_exit, is_transformed, runtime_of
from . import checkpoints as ckpt
from .options import ZeroOptions
from .precision import ZeroFabricPrecision
from .strategy import (checked_precision, load, mesh_group, refuse_optimizers, register,
                       save_path, tear_down)


class ZeroFabricStrategy(DDPStrategy, _Sharded):
    """Lightning's ``Fabric`` training through zerofn, with the options of
    ``ZeroStrategy`` (``precision`` for ``precision_plugin``), and the same registered
    names: ``Fabric(strategy="zerofn_stage_3")``.

    ``fabric.setup(model, optimizer)`` applies the transform to both (one model and one
    optimizer per strategy: zerofn shards them together); ``fabric.setup(model)`` alone
    shards a model to evaluate. ``fabric.init_module(empty_init=True)`` builds on the meta
    device. ``fabric.no_backward_sync`` is zerofn's ``no_sync``; ``fabric.clip_gradients``
    clips by zerofn's global norm; each ``optimizer.step()`` clears zerofn's gradient
    shards. ``fabric.save``/``fabric.load`` write and read zerofn's sharded checkpoint (a
    directory: any world size and stage), or one full file under
    ``state_dict_type="full"``.

    Example:
        >>> from zerofn.integrations.lightning import register_strategies
        >>> register_strategies()
        >>> fabric = L.Fabric(strategy="zerofn_stage_2", devices=2, precision="bf16-mixed")
        >>> fabric.launch()
        >>> model, optimizer = fabric.setup(model, optimizer)
    """

    def __init__(self, stage: int = 3, *, state_dict_type: str = "sharded", accelerator=None,
                 parallel_devices=None, cluster_environment=None, checkpoint_io=None,
                 precision=None, process_group_backend=None, timeout=default_pg_timeout,
                 start_method: str = "popen", **options):
        self.zero = ZeroOptions.from_kwargs(stage, state_dict_type=state_dict_type, **options)
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision=precision, process_group_backend=process_group_backend,
                         timeout=timeout, start_method=start_method)
        self._backward_sync_control = _NoSync()
        self._group = None
        self._module: nn.Module | None = None
        self._names: list[str] = []      # the optimizer's parameters, in its order

    # -- Lightning's settings -------------------------------------------------------------
    @property
    def precision(self) -> ZeroFabricPrecision:
        return self._precision

    @precision.setter
    def precision(self, plugin) -> None:
        self._precision = checked_precision(self, plugin, ZeroFabricPrecision)

    def _configure_launcher(self) -> None:
        if self.num_processes > 1:
            super()._configure_launcher()

    def setup_environment(self) -> None:
        super().setup_environment()
        self._group = mesh_group(self)
        finish_collectives_at_exit()    # the strategy runs the process's distributed life

    # -- building the model ---------------------------------------------------------------
    def module_init_context(self, empty_init: bool | None = None):
        """``fabric.init_module(empty_init=True)`` builds on the meta device."""
        stack = contextlib.ExitStack()
        stack.enter_context(torch.device("meta") if empty_init else self.root_device)
        stack.enter_context(self.precision.module_init_context())
        return stack

    def module_sharded_context(self):
        return torch.device("meta")

    def module_to_device(self, module: nn.Module) -> None:
        if not ckpt.on_meta(module) and not is_transformed(module):
            module.to(self.root_device)

    def setup_module_and_optimizers(self, module, optimizers, scheduler=None):
        refuse_optimizers(len(optimizers), "fabric.setup() with")
        self._transform(module, optimizers[0], fitting=True)
        return module, optimizers, scheduler

    def setup_module(self, module: nn.Module) -> nn.Module:
        """A model without an optimizer, sharded to evaluate."""
        self._transform(module, ckpt.eval_optimizer(module), fitting=False)
        return module

    def setup_optimizer(self, optimizer):
        raise NotImplementedError(self._err_msg_joint_setup_required())

    def _transform(self, module: nn.Module, optimizer, fitting: bool) -> None:
        if self._module is not None:
            raise RuntimeError("ZeroFabricStrategy shards one model; set up one model per "
                               "Fabric.")
        self._names = ckpt.param_names(module, optimizer)
        self.zero.transform(self.precision.flag, self._group, self.zero.tensorboard_dir(),
                            fitting=fitting)(module, optimizer)
        self._module = module
        self.precision.bind(module)

    # -- the loop -------------------------------------------------------------------------
    def optimizer_step(self, optimizer, **kwargs):
        """The step, then zerofn's gradient shards cleared at once (as DeepSpeed's engine
        does), whichever ``zero_grad`` the loop calls."""
        out = super().optimizer_step(optimizer, **kwargs)
        self._module.zero_grad()
        return out

    def clip_gradients_norm(self, module, optimizer, max_norm, norm_type=2.0,
                            error_if_nonfinite=True) -> torch.Tensor:
        return self.precision.clip(float(max_norm), True, float(norm_type), error_if_nonfinite)

    def clip_gradients_value(self, module, optimizer, clip_val) -> None:
        self.precision.clip(float(clip_val), False)

    def get_optimizer_state(self, optimizer) -> dict:
        """zerofn's optimizer state dict (FQN keys; sharded, or full when
        ``state_dict_type="full"``)."""
        return zf.get_state_dict(self._module, optimizer,
                                 full=self.zero.state_dict_type == "full")[1]

    # -- checkpoints ----------------------------------------------------------------------
    def save_checkpoint(self, path, state: dict, storage_options=None, filter=None) -> None:
        """zerofn's sharded checkpoint at ``path`` (a directory), the rest of ``state``
        riding along (rank 0's), or one full file under ``state_dict_type="full"``."""
        if storage_options is not None or filter is not None:
            raise TypeError("ZeroFabricStrategy.save_checkpoint takes neither storage_options "
                            "nor filter: zerofn writes the whole model and optimizer itself.")
        model_key, optim_key = self._keys(state)
        rest = {k: v.state_dict() if isinstance(v, _Stateful) else v
                for k, v in state.items() if k not in (model_key, optim_key)}
        path, sharded = save_path(self, path)
        optimizer = runtime_of(self._module).optimizer
        if sharded:
            step = rest.get("step")
            ckpt.save_sharded(path, self._module, optimizer, step if isinstance(step, int) else 0,
                              ckpt.FABRIC_EXTRA, self.broadcast(rest))
            return
        model_state, optim_state = ckpt.full_state(self._module,
                                                   optimizer if optim_key else None)
        full = {model_key: model_state, **({optim_key: optim_state} if optim_key else {}), **rest}
        if self.is_global_zero:
            self.checkpoint_io.save_checkpoint(full, path)

    def load_checkpoint(self, path, state=None, strict: bool = True, weights_only=None) -> dict:
        """Load into the state's model (and optimizer, where the state has it) at any world
        size and stage; the rest of the state as ``Fabric.load`` does: ``Stateful`` objects
        in place, other values into ``state``; returns what the state did not ask for."""
        if isinstance(state, nn.Module):
            state = {"model": state}
        if not isinstance(state, dict) or not state:
            raise ValueError("ZeroFabricStrategy.load_checkpoint needs the state to load into, "
                             "with the set-up model: fabric.load(path, {'model': model, ...}).")
        model_key, optim_key = self._keys(state)
        optimizer = runtime_of(self._module).optimizer if optim_key else None
        saved = load(self, path, self._module, optimizer, ckpt.FABRIC_EXTRA,
                     lambda e: (e.pop(model_key), e.pop(optim_key, None) if optim_key else None),
                     weights_only)
        rest = [k for k in state if k not in (model_key, optim_key)]
        _validate_keys_for_strict_loading(rest, saved.keys(), strict=strict)
        for name in rest:
            if name in saved:
                if isinstance(state[name], _Stateful):
                    state[name].load_state_dict(saved.pop(name))
                else:
                    state[name] = saved.pop(name)
        return saved

    def _keys(self, state: dict):
        """The keys of the set-up model and (if there) its optimizer in ``state``."""
        if self._module is None:
            raise RuntimeError("Set up the model with fabric.setup(model, optimizer) first.")
        model_key = next((k for k, v in state.items() if v is self._module), None)
        if model_key is None:
            raise ValueError("The state holds no model set up by this ZeroFabricStrategy: "
                             "save and load it with the model fabric.setup returned.")
        optimizer = runtime_of(self._module).optimizer
        optim_key = next((k for k, v in state.items() if v is optimizer), None)
        return model_key, optim_key

    def teardown(self) -> None:
        tear_down(self, self._module, self.precision)

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        """Register ``zerofn_stage_1`` ... ``zerofn_stage_3_offload_nvme`` with Fabric."""
        register(cls, strategy_registry)


class _NoSync(_BackwardSyncControl):
    """``fabric.no_backward_sync(model)``: zerofn's ``no_sync``."""

    def no_backward_sync(self, module: nn.Module, enabled: bool):
        if enabled and is_transformed(module):
            return module.no_sync()
        return contextlib.nullcontext()
