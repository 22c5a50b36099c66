"""DeepSpeed's engine checkpoint calls: ``save_checkpoint`` and ``load_checkpoint`` on zerofn's
DCP format under DeepSpeed's directory layout (``save_dir/<tag>`` and a ``latest`` file
naming the tag), and ``save_16bit_model``."""
from __future__ import annotations

import os
import warnings

import torch
import torch.distributed as dist

from ..checkpoint import load_checkpoint as zf_load_checkpoint
from ..checkpoint import save_checkpoint as zf_save_checkpoint
from ..io.fs import write_file
from ..runtime.agree import from_first, gather
from ..state.state_dict import get_model_state_dict
from .config import DeepSpeedConfigWarning

LATEST = "latest"


class EngineCheckpoints:
    """The checkpoint methods of ``DeepSpeedEngine``, which it inherits. They use the
    engine's ``module``, ``optimizer``, ``lr_scheduler``, ``settings``, ``group`` and step
    counters."""

    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest: bool = True,
                        exclude_frozen_parameters: bool = False) -> bool:
        """Save model, optimizer, scheduler, counters and ``client_state`` under
        ``save_dir/<tag>`` (default tag ``global_step<N>``) as a zerofn DCP checkpoint, and
        name the tag in ``save_dir/latest``. Call on every rank.

        ``client_state`` is rank 0's, as in DeepSpeed. ``exclude_frozen_parameters`` is not
        honoured: zerofn saves every parameter.
        """
        if not save_dir:
            raise ValueError(f"save_dir must be a non-empty path, got {save_dir!r}.")
        tag = str(f"global_step{self.global_steps}" if tag is None else tag)
        client_state = self._agree_on_tag(tag, client_state or {})
        if exclude_frozen_parameters:
            warnings.warn("save_checkpoint(exclude_frozen_parameters=True): zerofn saves every "
                          "parameter.", DeepSpeedConfigWarning, stacklevel=2)
        extras = {"engine": self._counters(), "client_state": client_state}
        if self.lr_scheduler is not None:
            extras["lr_scheduler"] = self.lr_scheduler
        zf_save_checkpoint(os.path.join(os.fspath(save_dir), tag), self.module, self.optimizer,
                           step=self.global_steps, keep=1, **extras)
        if save_latest and dist.get_rank(self.group) == 0:
            write_file(os.path.join(os.fspath(save_dir), LATEST), tag)   # (no newline)
        dist.barrier(self.group)
        return True

    def load_checkpoint(self, load_dir, tag=None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False, custom_load_fn=None, *,
                        trusted: bool = False):
        """Load what ``save_checkpoint`` wrote under ``load_dir/<tag>`` (default: the tag in
        ``load_dir/latest``). Call on every rank.

        Returns:
            ``(checkpoint directory, client_state)``, or ``(None, None)`` with a warning when
            there is no such checkpoint. ``load_module_only`` loads only the weights;
            without ``load_optimizer_states`` the optimizer keeps its state and the counters
            and scheduler are still restored. Loading is always strict.
            ``trusted`` is ``zerofn.load_checkpoint``'s: without it, pickles naming classes
            a checkpoint does not hold are refused (``zerofn.trust_class`` admits one).
        """
        if custom_load_fn is not None:
            raise ValueError("load_checkpoint(custom_load_fn=...) is not supported by zerofn.")
        path = self._checkpoint_dir(os.fspath(load_dir), tag)
        if path is None:
            return None, None
        extras = {"engine": None, "client_state": None}
        if self.lr_scheduler is not None and load_lr_scheduler_states and not load_module_only:
            extras["lr_scheduler"] = self.lr_scheduler
        with_optimizer = load_optimizer_states and not load_module_only
        loaded = zf_load_checkpoint(path, self.module, self.optimizer if with_optimizer else None,
                                    trusted=trusted, **extras)
        if loaded is None:
            raise FileNotFoundError(f"{path} holds no complete checkpoint (an unfinished save, "
                                    "or not written by save_checkpoint); pick another tag.")
        if not load_module_only:
            for name, value in loaded["engine"].items():
                setattr(self, name, value)
        return path, loaded["client_state"]

    def save_16bit_model(self, save_dir, save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        """Rank 0 writes the full weights (``torch.save`` of a state dict) in the compute
        dtype: fp16 or bf16, fp32 without mixed precision. Call on every rank. Every stage
        gathers (DeepSpeed's ZeRO-3 needs ``stage3_gather_16bit_weights_on_model_save``)."""
        state = get_model_state_dict(self.module, full=True)
        if exclude_frozen_parameters:
            frozen = {n for n, p in self.module.named_parameters() if not p.requires_grad}
            state = {k: v for k, v in state.items() if k not in frozen}
        if dist.get_rank(self.group) == 0:
            dtype = self.settings.param_dtype
            os.makedirs(save_dir, exist_ok=True)
            torch.save({k: v.to(dtype) if dtype is not None and v.is_floating_point() else v
                        for k, v in state.items()}, os.path.join(save_dir, save_filename))
        dist.barrier(self.group)
        return True

    save_fp16_model = save_16bit_model

    _COUNTERS = ("global_steps", "global_samples", "skipped_steps")

    def _counters(self) -> dict:
        return {name: getattr(self, name) for name in self._COUNTERS}

    def _agree_on_tag(self, tag: str, client_state: dict) -> dict:
        """One small collective: every rank saves under the same tag (else every rank raises),
        and rank 0's client_state is the one saved."""
        gathered = gather((tag, client_state), self.group)
        for rank, (other, _) in enumerate(gathered):
            if other != gathered[0][0]:
                raise ValueError(f"save_checkpoint: rank {rank} passed tag {other!r} where "
                                 f"rank 0 passed {gathered[0][0]!r}; pass the same tag on "
                                 f"every rank (or none).")
        return gathered[0][1]

    def _checkpoint_dir(self, load_dir: str, tag) -> str | None:
        """Rank 0 finds the checkpoint (DeepSpeed's ``latest`` file names the tag) and tells
        the others, so every rank loads the same one or none does."""
        found = None
        if dist.get_rank(self.group) == 0:
            try:
                found = _find_checkpoint(load_dir, tag)
            except OSError as e:      # told to every rank, not raised here alone
                found = e
        found = from_first(found, self.group)
        if isinstance(found, Exception):
            raise ValueError(f"load_checkpoint: rank 0 could not read {load_dir}: {found}. "
                             "Nothing was loaded.") from found
        path, problem = found
        if problem:
            warnings.warn(problem, DeepSpeedConfigWarning, stacklevel=3)
        return path


def _find_checkpoint(load_dir: str, tag) -> tuple[str | None, str | None]:
    """``(checkpoint directory, None)``, or ``(None, why there is none)``."""
    if tag is None:
        latest = os.path.join(load_dir, LATEST)
        if not os.path.isfile(latest):
            return None, (f"load_checkpoint: no {latest} file; pass tag= to load a particular "
                          f"checkpoint. Nothing was loaded.")
        with open(latest) as f:
            tag = f.read().strip()
    path = os.path.join(load_dir, str(tag))
    if not os.path.isdir(path):
        return None, f"load_checkpoint: no checkpoint at {path}. Nothing was loaded."
    return path, None
