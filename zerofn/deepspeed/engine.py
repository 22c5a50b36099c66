"""DeepSpeed's ``initialize`` and engine, as a thin object over a plain module and zerofn.

The engine holds the user's module (transformed in place by zerofn) and the user's or the
config's optimizer (rewired in place); it adds only DeepSpeed's loop bookkeeping: loss
division by the accumulation steps, micro-step counting, the step at accumulation
boundaries with clipping and the scheduler, and checkpoints on zerofn's DCP format.
"""
from __future__ import annotations

import argparse
import atexit
import datetime
import gc
import os
import socket

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

from ..state.clip import clip_grad_norm_
from ..state.loss_scale import scale_loss
from ..runtime import finish_collectives_at_exit, runtime_of
from .config import load_config, read_config
from .engine_checkpoint import EngineCheckpoints

DEFAULT_PORT = 29500


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add DeepSpeed's command-line flags (``--deepspeed``, ``--deepspeed_config`` and their
    deprecated ``--deepscale`` twins) to ``parser``, as ``deepspeed.add_config_arguments``."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="Enable DeepSpeed (a flag for user code; no effect here)")
    group.add_argument("--deepspeed_config", default=None, type=str,
                       help="DeepSpeed json configuration file.")
    group.add_argument("--deepscale", default=False, action="store_true",
                       help="Deprecated --deepspeed")
    group.add_argument("--deepscale_config", default=None, type=str,
                       help="Deprecated --deepspeed_config")
    return parser


def init_distributed(dist_backend: str | None = None, auto_mpi_discovery: bool = True,
                     distributed_port: int = DEFAULT_PORT, verbose: bool = True,
                     timeout: datetime.timedelta = datetime.timedelta(minutes=30),
                     init_method: str | None = None, dist_init_required: bool | None = None,
                     config=None, rank: int = -1, world_size: int = -1) -> None:
    """Initialize torch.distributed as DeepSpeed does, if it is not already.

    The launcher's environment (torchrun's RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT,
    LOCAL_RANK) is used; the backend is nccl with CUDA, gloo without (or with
    ``DS_ACCELERATOR=cpu``). Started without a
    launcher, it forms a one-process group (DeepSpeed would look for MPI instead).
    ``auto_mpi_discovery``, ``verbose`` and ``config`` are accepted for DeepSpeed's
    signature and do nothing here.
    """
    if dist.is_initialized():
        return
    if dist_init_required is False:
        raise RuntimeError("torch.distributed is not initialized and dist_init_required=False; "
                           "initialize it first, or leave dist_init_required unset.")
    backend = dist_backend or ("nccl" if _on_cuda() else "gloo")
    if init_method is None and rank < 0 and "RANK" not in os.environ:
        init_method, rank, world_size = f"tcp://127.0.0.1:{_free_port()}", 0, 1
    else:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(distributed_port))
    dist.init_process_group(backend, init_method=init_method, timeout=timeout, rank=rank,
                            world_size=world_size)
    atexit.register(_end_group, dist.group.WORLD)
    if _on_cuda():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))


def _end_group(made) -> None:
    """At exit, the process group ``init_distributed`` made, if it is still the one: a
    DeepSpeed script leaves it to the interpreter's exit, and a group zerofn made is
    zerofn's to destroy (the exit abort on gloo is ``finish_collectives_at_exit``'s, which
    ``initialize`` calls; docs/multinode.md). Only a group zerofn made is ended here: one
    the script made is the script's."""
    if dist.is_initialized() and dist.group.WORLD is made:
        gc.collect()      # the runtime and the model refer to each other
        dist.destroy_process_group()


def _on_cuda() -> bool:
    """Train on CUDA when there is one, unless ``DS_ACCELERATOR=cpu`` picks the CPU, as it
    picks DeepSpeed's CPU accelerator."""
    return torch.cuda.is_available() and os.environ.get("DS_ACCELERATOR", "cuda") != "cpu"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def initialize(args=None, model: nn.Module | None = None, optimizer=None, model_parameters=None,
               training_data=None, lr_scheduler=None, distributed_port: int = DEFAULT_PORT,
               mpu=None, dist_init_required: bool | None = None, collate_fn=None, config=None,
               mesh_param=None, config_params=None):
    """``deepspeed.initialize`` on zerofn, with DeepSpeed 0.19.8's signature.

    Args:
        args: an object with ``deepspeed_config`` (a path; or the deprecated
            ``deepscale_config``) and optionally ``local_rank``, as argparse gives with
            ``add_config_arguments``. Not needed when ``config`` is passed.
        model: the plain ``nn.Module``; transformed in place and moved to this rank's device.
        optimizer: a torch optimizer, or a callable building one from the parameters; it
            wins over the config's "optimizer" section.
        model_parameters: what the config's optimizer (or the callable) optimizes
            (default: all of the model's parameters).
        training_data: a Dataset; the returned loader samples it with a
            DistributedSampler in micro-batches, as DeepSpeed's does.
        lr_scheduler: a scheduler, or a callable building one from the optimizer; it wins
            over the config's "scheduler" section.
        mpu: a model-parallel unit; zerofn shards over its data-parallel group.
        dist_init_required: None initializes torch.distributed if needed; False requires
            it initialized already.
        collate_fn: the data loader's collate function.
        config, config_params: the DeepSpeed config, a dict or a JSON path.
        distributed_port: the rendezvous port when the environment names none.
        mesh_param: DeepSpeed's (data, sequence) mesh; zerofn has no sequence parallelism.

    Returns:
        ``(engine, optimizer, training_dataloader, lr_scheduler)``; the last two may be None.

    Example:
        >>> import zerofn.deepspeed as deepspeed
        >>> engine, opt, loader, sched = deepspeed.initialize(args=args, model=net,
        ...     model_parameters=net.parameters(), training_data=dataset)
    """
    if model is None:
        raise ValueError("initialize() requires a model.")
    if mesh_param is not None:
        raise ValueError("initialize(mesh_param=...): zerofn shards over one data-parallel "
                         "group and has no sequence parallelism; pass mpu= to name the group.")
    init_distributed(distributed_port=distributed_port, dist_init_required=dist_init_required)
    finish_collectives_at_exit()     # a DeepSpeed script leaves its end to the interpreter
    engine = DeepSpeedEngine(args=args, model=model, optimizer=optimizer,
                             model_parameters=model_parameters, training_data=training_data,
                             lr_scheduler=lr_scheduler, mpu=mpu, collate_fn=collate_fn,
                             config=_config_from(args, config, config_params))
    return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler


def _config_from(args, config, config_params):
    """DeepSpeed's precedence: ``config``, else ``config_params``, else ``args.deepspeed_config``
    (giving both a config and ``args.deepspeed_config`` is an error)."""
    if config is None:
        config = config_params
    from_args = getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config", None)
    if from_args is not None:
        if config is not None:
            raise ValueError("initialize() got both args.deepspeed_config and a config= / "
                             "config_params=; pass one of them.")
        config = from_args
    if config is None:
        raise ValueError("initialize() needs a DeepSpeed config: pass config= (a dict or a JSON "
                         "path), or args with --deepspeed_config.")
    return load_config(config)


class DeepSpeedEngine(EngineCheckpoints, nn.Module):
    """DeepSpeed's engine API over a zerofn-transformed module; see ``initialize``. The
    checkpoint methods come from ``EngineCheckpoints`` (engine_checkpoint.py).

    Attributes not found on the engine are looked up on the module, as DeepSpeed does.
    """

    def __init__(self, args, model, optimizer, model_parameters, training_data, lr_scheduler,
                 mpu, collate_fn, config):
        super().__init__()
        self.mpu = mpu
        self.group = mpu.get_data_parallel_group() if mpu is not None else dist.group.WORLD
        self.global_rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.dp_world_size = dist.get_world_size(self.group)
        self.local_rank = _local_rank(args)
        self.device = torch.device(f"cuda:{self.local_rank}") if _on_cuda() \
            else torch.device("cpu")
        self.settings = read_config(config, model=model, world_size=self.dp_world_size,
                                    group=None if mpu is None else self.group)
        self.config = self.settings.config
        model.to(self.device)
        client_optimizer = self._make_optimizer(model, optimizer, model_parameters)
        model, self.optimizer = self.settings.transform(model, client_optimizer)
        self.module = model
        self.lr_scheduler = self._make_scheduler(lr_scheduler)
        self.collate_fn = collate_fn
        self.training_dataloader = None if training_data is None else \
            self.deepspeed_io(training_data)
        self.global_steps = self.global_samples = self.micro_steps = self.skipped_steps = 0
        self._boundary = None           # set_gradient_accumulation_boundary's override
        self._global_grad_norm = None
        self._step_applied = False

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            module = self.__dict__.get("_modules", {}).get("module")
            if module is None:
                raise
            return getattr(module, name)

    # -- set-up ------------------------------------------------------------------------
    def _make_optimizer(self, model, optimizer, model_parameters):
        params = model.parameters() if model_parameters is None else model_parameters
        if isinstance(optimizer, torch.optim.Optimizer):
            return optimizer
        if callable(optimizer):
            return optimizer(params)
        if optimizer is not None:
            raise TypeError(f"initialize(optimizer=...) takes a torch optimizer or a callable "
                            f"building one; got {type(optimizer).__name__}.")
        if self.settings.optimizer is None:
            raise ValueError("initialize() needs an optimizer: pass optimizer=, or add an "
                             "\"optimizer\" section to the DeepSpeed config.")
        return self.settings.optimizer(params)

    def _make_scheduler(self, lr_scheduler):
        if lr_scheduler is not None:
            return lr_scheduler(self.optimizer) if callable(lr_scheduler) else lr_scheduler
        return None if self.settings.scheduler is None else self.settings.scheduler(self.optimizer)

    def deepspeed_io(self, dataset, batch_size: int | None = None, route: str = "train",
                     pin_memory: bool = True, data_sampler=None, collate_fn=None,
                     num_local_io_workers: int | None = None) -> DataLoader:
        """A DataLoader over ``dataset`` in micro-batches, each rank reading its share
        through a DistributedSampler (shuffled for training, seed 0, as DeepSpeed's).
        Workers default to 0 (DeepSpeed starts two; the batches are the same)."""
        if not isinstance(dataset, torch.utils.data.Dataset):
            raise ValueError("training_data must be a torch.utils.data.Dataset.")
        if data_sampler is None:
            rank = self.mpu.get_data_parallel_rank() if self.mpu is not None else self.global_rank
            data_sampler = DistributedSampler(dataset, num_replicas=self.dp_world_size,
                                              rank=rank, shuffle=route == "train")
        return DataLoader(dataset, batch_size=batch_size or self.train_micro_batch_size_per_gpu(),
                          sampler=data_sampler, collate_fn=collate_fn or self.collate_fn,
                          num_workers=num_local_io_workers or 0,
                          pin_memory=pin_memory and _on_cuda(),
                          drop_last=self.settings.dataloader_drop_last)

    # -- the loop ----------------------------------------------------------------------
    def forward(self, *inputs, **kwargs):
        if self.settings.fp16_auto_cast:
            inputs, kwargs = _to_half(inputs), _to_half(kwargs)
        return self.module(*inputs, **kwargs)

    def backward(self, loss: torch.Tensor, retain_graph: bool = False,
                 scale_wrt_gas: bool = True) -> torch.Tensor:
        """Backward of ``loss / gradient_accumulation_steps()`` (unless ``scale_wrt_gas`` is
        False), times the fp16 loss scale. Returns the divided, unscaled loss."""
        if not (torch.is_tensor(loss) and loss.numel() == 1):
            raise ValueError("engine.backward(loss) takes a scalar loss tensor.")
        loss = loss / self.gradient_accumulation_steps() if scale_wrt_gas else loss
        scale_loss(self.module, loss).backward(retain_graph=retain_graph)
        return loss

    def step(self, lr_kwargs: dict | None = None) -> None:
        """Count a micro-step; at an accumulation boundary, clip, step the optimizer (skipped
        on every rank after an fp16 overflow), zero the gradients and step the scheduler."""
        self._step_applied = False
        if self.is_gradient_accumulation_boundary():
            self._take_model_step(lr_kwargs)
        self.micro_steps += 1

    def _take_model_step(self, lr_kwargs: dict | None) -> None:
        clip = self.gradient_clipping()
        if clip > 0:
            self._global_grad_norm = float(clip_grad_norm_(self.module, clip))
        self.optimizer.step()
        overflow = runtime_of(self.module).step_skipped()
        self.optimizer.zero_grad()
        self._step_applied = not overflow
        if overflow:
            self.skipped_steps += 1
        elif self.lr_scheduler is not None:
            self.lr_scheduler.step(**(lr_kwargs or {}))
        self.global_steps += 1
        self.global_samples += self.train_batch_size()
        self._report_progress()

    def _report_progress(self) -> None:
        every = self.steps_per_print()
        if every and self.global_steps % every == 0 and self.global_rank == 0:
            print(f"[zerofn.deepspeed] step={self.global_steps}, skipped={self.skipped_steps}, "
                  f"lr={self.get_lr()}, mom={self.get_mom()}", flush=True)

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the next ``step()`` steps the optimizer: every
        ``gradient_accumulation_steps()``-th micro-step, unless overridden."""
        if self._boundary is not None:
            return self._boundary
        return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool | None) -> None:
        """Override the micro-step count's verdict (None returns to counting)."""
        self._boundary = is_boundary

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none)

    def no_sync(self):
        """Skip gradient reduction in the backward calls inside (zerofn's ``no_sync``)."""
        return self.module.no_sync()

    # -- what DeepSpeed's engine reports ------------------------------------------------
    def train_batch_size(self) -> int:
        return self.settings.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.settings.micro_batch_size

    def gradient_accumulation_steps(self) -> int:
        return self.settings.gradient_accumulation_steps

    def gradient_clipping(self) -> float:
        return self.settings.gradient_clipping

    def zero_optimization_stage(self) -> int:
        return self.settings.stage

    def zero_optimization(self) -> bool:
        return self.settings.stage > 0

    def fp16_enabled(self) -> bool:
        return self.settings.param_dtype == torch.float16

    def bfloat16_enabled(self) -> bool:
        return self.settings.param_dtype == torch.bfloat16

    def steps_per_print(self) -> int | None:
        return self.settings.steps_per_print

    def loss_scale(self) -> float:
        """The scale the next backward multiplies the loss by (1.0 without fp16). DeepSpeed's
        engine returns the configured static scale here (0 for dynamic); its optimizer's
        ``cur_scale`` is this value."""
        scale = runtime_of(self.module).loss_scale()
        return 1.0 if scale is None else scale

    def get_lr(self) -> list:
        return [group["lr"] for group in self.optimizer.param_groups]

    def get_mom(self) -> list:
        key = "betas" if "betas" in self.optimizer.param_groups[0] else "momentum"
        return [group.get(key, 0.0) for group in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> float | None:
        """The global gradient norm before clipping at the last optimizer step (None while
        clipping is off: zerofn then computes no norm)."""
        return self._global_grad_norm

    def was_step_applied(self) -> bool:
        """Whether the last ``step()`` updated the parameters (False at non-boundaries and
        after an fp16 overflow)."""
        return self._step_applied


def _local_rank(args) -> int:
    if "LOCAL_RANK" in os.environ:
        return int(os.environ["LOCAL_RANK"])
    from_args = getattr(args, "local_rank", -1)
    if from_args is not None and from_args >= 0:
        return from_args
    count = torch.cuda.device_count() if _on_cuda() else 0
    return dist.get_rank() % count if count else dist.get_rank()


def _to_half(obj):
    """fp16.auto_cast: floating tensors in the inputs become fp16, as DeepSpeed casts them."""
    if torch.is_tensor(obj):
        return obj.half() if obj.is_floating_point() else obj
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_half(v) for v in obj)
    if isinstance(obj, dict):
        return {k: _to_half(v) for k, v in obj.items()}
    return obj

