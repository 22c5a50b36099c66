"""What the Trainer's and Fabric's strategies share: their options, the zerofn transform
those options and Lightning's precision flag become, and the checks of what Lightning asks
that zerofn cannot honour. Nothing here imports Lightning."""
from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.device_mesh import init_device_mesh

import zerofn as zf
from zerofn.config import Config

PARAM_OPTIONS = ("prefetch", "reshard_after_forward", "persist_below")     # ZeRO-3's own
SCALING_OPTIONS = ("loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
                   "min_loss_scale")
STATE_DICT_TYPES = ("sharded", "full")


@dataclass(frozen=True)
class Flag:
    """One of Lightning's precision flags, as zerofn trains it."""
    compute: torch.dtype | None    # zf.mixed_precision's compute dtype (fp32 masters kept)
    module: torch.dtype | None     # the dtype the module itself is cast to (no masters)

    @property
    def inputs(self) -> torch.dtype | None:
        """What floating inputs are cast to: the dtype the parameters compute in."""
        return self.compute or self.module


FLAGS = {
    "32-true": Flag(None, None),
    "bf16-mixed": Flag(torch.bfloat16, None),
    "16-mixed": Flag(torch.float16, None),          # zerofn's dynamic loss scaler
    "bf16-true": Flag(None, torch.bfloat16),
}

# The names registered with Lightning, mirroring its DeepSpeed ones: the strategy's options.
REGISTERED = {
    "zerofn_stage_1": ("ZeRO-1", dict(stage=1)),
    "zerofn_stage_2": ("ZeRO-2", dict(stage=2)),
    "zerofn_stage_2_offload": ("ZeRO-2, optimizer state offloaded to the host",
                               dict(stage=2, offload="cpu")),
    "zerofn_stage_3": ("ZeRO-3", dict(stage=3)),
    "zerofn_stage_3_offload": ("ZeRO-3, optimizer state and parameters offloaded to the host",
                               dict(stage=3, offload="cpu", offload_params=True)),
    "zerofn_stage_3_offload_nvme": ("ZeRO-3, optimizer state and parameters in an NVMe "
                                    "swap file", dict(stage=3, offload="nvme",
                                                      offload_params=True)),
}


@dataclass(frozen=True)
class ZeroOptions:
    """The options of ``ZeroStrategy`` and ``ZeroFabricStrategy`` that become the zerofn
    transform; each is the zerofn option of the same name (``docs/lightning.md``)."""
    stage: int = 3
    offload: str | None = None
    offload_params: bool = False
    nvme_path: str | None = None
    offload_ratio: float | str = 1.0
    state_dtype: torch.dtype = torch.float32
    master_dtype: torch.dtype = torch.float32
    overlap_step: bool = False
    device_budget: int | float | None = None
    device_mesh: Any = None
    sharding: dict = field(default_factory=dict)    # bucket_size, units, init, ZeRO-3's own
    scaling: dict = field(default_factory=dict)     # reduce_dtype and fp16 loss scaling
    state_dict_type: str = "sharded"
    tensorboard: Any = None

    def __post_init__(self):
        if self.stage not in (1, 2, 3):
            raise ValueError(f"stage={self.stage!r}: zerofn's strategy takes stage 1, 2 or 3.")
        if self.state_dict_type not in STATE_DICT_TYPES:
            raise ValueError(f"state_dict_type={self.state_dict_type!r}: 'sharded' (zerofn's "
                             "DCP checkpoint, a directory) or 'full' (one file, rank 0).")
        if self.tensorboard is not None and not isinstance(self.tensorboard, (bool, str, dict)):
            raise TypeError(f"tensorboard={self.tensorboard!r}: True (the Trainer's "
                            "TensorBoardLogger directory), a directory, or a dict of "
                            "zerofn.tensorboard's options (logdir=, every=, ranks=, ...).")
        # zerofn's transforms check the values (the precision ones under a mixed flag)
        self.transform(FLAGS["bf16-mixed" if self.scaling else "32-true"], None, None,
                       fitting=True)

    @classmethod
    def from_kwargs(cls, stage: int, **kwargs) -> "ZeroOptions":
        """Split the strategies' flat keyword options into sharding and scaling options."""
        unknown = sorted(set(kwargs) - set(OPTIONS))
        if unknown:
            raise TypeError(f"zerofn's Lightning strategy got unknown option(s) {unknown}; "
                            f"it accepts {sorted(OPTIONS)}.")
        sharding = {k: kwargs.pop(k) for k in ("bucket_size", "units", "init", *PARAM_OPTIONS)
                    if kwargs.get(k) is not None}
        scaling = {k: kwargs.pop(k) for k in ("reduce_dtype", *SCALING_OPTIONS)
                   if kwargs.get(k) is not None}
        kwargs = {k: v for k, v in kwargs.items() if v is not None}
        return cls(stage=stage, sharding=sharding, scaling=scaling, **kwargs)

    # -- the transform ---------------------------------------------------------------------
    def transform(self, flag: Flag, group, logdir: str | None, *, fitting: bool) -> zf.Transform:
        """The zerofn transform: the stage over ``group``, precision, offload (training
        only: an evaluation holds no optimizer state) and TensorBoard in ``logdir``."""
        own = {k: self.sharding[k] for k in PARAM_OPTIONS if k in self.sharding}
        sharding = {k: v for k, v in self.sharding.items() if k not in own}
        if group is not None:
            sharding["group"] = group
        precision = None if flag.compute is None else dict(self.scaling, param_dtype=flag.compute)
        offload = None if self.offload is None or not fitting else dict(
            device=self.offload, params=self.offload_params, path=self.swap_path(),
            ratio=self.offload_ratio, state_dtype=self.state_dtype,
            master_dtype=self.master_dtype, overlap_step=self.overlap_step,
            device_budget=self.device_budget)
        tensorboard = None if logdir is None or not fitting else \
            dict(self.tensorboard_options(), logdir=logdir)
        return Config(self.stage, sharding=sharding, params=own, precision=precision,
                      offload=offload, tensorboard=tensorboard).transform()

    def swap_path(self) -> str | None:
        """NVMe's swap directory: ``nvme_path``, else the system's temporary directory."""
        if self.offload != "nvme":
            return None
        return self.nvme_path or tempfile.gettempdir()

    def tensorboard_options(self) -> dict:
        """zerofn.tensorboard's options but the directory."""
        if not isinstance(self.tensorboard, dict):
            return {}
        return {k: v for k, v in self.tensorboard.items() if k != "logdir"}

    def tensorboard_dir(self, logger_dir=None) -> str | None:
        """Where zerofn's TensorBoard series go: the directory asked for, else
        ``logger_dir`` (the Trainer's TensorBoardLogger's); None when not asked."""
        asked = self.tensorboard
        if not asked:
            return None
        explicit = asked if isinstance(asked, str) else \
            asked.get("logdir") if isinstance(asked, dict) else None
        if explicit is None and logger_dir is None:
            raise ValueError(f"tensorboard={asked!r} puts zerofn's series beside a "
                             "TensorBoardLogger's, and there is none: add "
                             "Trainer(logger=TensorBoardLogger(...)), or name the directory "
                             "(tensorboard='runs/x').")
        return explicit or logger_dir

    def mesh(self, device: torch.device, world: int):
        """``device_mesh`` as zerofn's ``group``: a (replicas, shards) shape becomes a 2-D
        mesh (hybrid sharding, HSDP); a DeviceMesh or ProcessGroup is used as given."""
        shape = self.device_mesh
        if not isinstance(shape, tuple):
            return shape
        if len(shape) != 2 or shape[0] * shape[1] != world:
            raise ValueError(f"device_mesh={shape}: (replicas, shards) whose product is the "
                             f"world size, {world}.")
        return init_device_mesh(device.type, shape, mesh_dim_names=("replicate", "shard"))

    # -- what zerofn cannot honour --------------------------------------------------------
    def precision_problems(self, flag_name: str) -> list[str]:
        """Lightning's precision flag (one of ``FLAGS``) against these options."""
        problems = []
        if FLAGS[flag_name].compute is None and self.scaling:
            problems.append(f"{', '.join(sorted(self.scaling))} set, but precision="
                            f"{flag_name!r} computes without zerofn.mixed_precision; use "
                            "'bf16-mixed' or '16-mixed'")
        if self.overlap_step and flag_name == "16-mixed":
            problems.append("overlap_step=True with precision='16-mixed': the host steps "
                            "during backward, before fp16's overflow check could skip it")
        return problems

    @staticmethod
    def launch_problems(start_method: str) -> list[str]:
        """The Trainer's: after a spawned or forked fit, Lightning loads rank 0's state
        dict into the main process's module, which under zerofn is a shard."""
        if start_method != "popen":
            return [f"start_method={start_method!r}: after a spawned or forked fit Lightning "
                    "hands the main process one rank's state dict, which under zerofn is a "
                    "shard; launch with 'popen' (Lightning re-runs the script) or torchrun"]
        return []

    def trainer_problems(self, clip_val, layer_sync) -> list[str]:
        """The Trainer's own options: clipping, and the layers it would convert."""
        problems = []
        if self.overlap_step and clip_val:
            problems.append(f"gradient_clip_val={clip_val} with overlap_step=True: the host "
                            "steps each unit during backward, before the global norm exists; "
                            "drop one of them")
        if layer_sync is not None:
            problems.append("sync_batchnorm=True: zerofn's strategy does not convert the "
                            "model's BatchNorm layers; convert them yourself "
                            "(torch.nn.SyncBatchNorm.convert_sync_batchnorm) in __init__")
        return problems


OPTIONS = tuple(f for f in ZeroOptions.__dataclass_fields__ if f not in ("stage", "sharding",
                                                                     "scaling")) \
    + ("bucket_size", "units", "init", *PARAM_OPTIONS, "reduce_dtype", *SCALING_OPTIONS)


def refuse(problems: list[str]) -> None:
    """Raise what zerofn cannot honour. Every rank runs the same checks on the same
    options, so every rank raises, before any collective."""
    if problems:
        raise ValueError("zerofn's Lightning strategy cannot honour " + "; ".join(problems) + ".")
