"""A runtime's optimizer step: the vote and the gradients' preparation, then CPU Adam on
the host (unit by unit, each unit's rows sent back as soon as it is done) or the user's
optimizer (on the device, unit by unit under ZeRO-1/2), then the updated rows shared."""
from __future__ import annotations

import torch

from .offload import cpu_adam_steps


class Stepping:
    """The part of ``Runtime`` that runs around ``optimizer.step()`` (a mixin, runtime.py)."""

    def before_step(self) -> None:
        skip = self.step_grads.settle()
        self._settle_copies()   # the step rewrites host rows the last step's copies read
        # Parameters without a gradient are left alone by torch.optim: that is how a
        # skipped step, and a step zerofn's CPU Adam already took, leave it nothing to do.
        on_host = self.offload is not None and self.offload.cpu_adam
        self._refreshed = not skip and (on_host or self._steps_per_unit())
        if self._refreshed and on_host:
            # Each unit's updated rows head back to the device as soon as CPU Adam is done
            # with the unit, overlapping the step of the next one; the kernel unscales and
            # clips the gradients as it reads them. Memory the offload reuses within the
            # step (the host ring, NVMe's staging ring) waits for those copies.
            self.offload.step(self.optimizer, self.step_grads.grads, self._refresh_unit,
                              self.step_grads.grad_scale, self.copies)
            self._await_shards()
        elif self._refreshed:
            self._step_unit_by_unit()
        for s in self.slot_of.values():
            s.opt_param.grad = None if skip or self._refreshed else self.step_grads.grads.get(s)

    def _steps_per_unit(self) -> bool:
        """ZeRO-1/2 with the optimizer on the device: step one unit at a time, so each
        unit's all-gather runs while the optimizer steps the next."""
        return self.offload is None and self.stage < 3 and len(self.units) > 1

    def _step_unit_by_unit(self) -> None:
        """The user's optimizer over one unit's rows at a time (torch.optim leaves params
        without a gradient alone, and steps each param from its own state, so this is the
        same step), each unit's rows shared as soon as they are updated."""
        grads = self.step_grads.grads
        self.opt.bypass = True
        try:
            for unit in self.units:
                for s in unit.slots:
                    s.opt_param.grad = grads.get(s)
                self.optimizer.step()
                for s in unit.slots:
                    s.opt_param.grad = None
                self._refresh_unit(unit, self._updated_rows(unit))
        finally:
            self.opt.bypass = False

    def after_step(self) -> None:
        skipped = self.step_grads.overflow
        if self.scaler is not None:
            self.scaler.update(skipped)
        for s in self.slot_of.values():
            s.opt_param.grad = None
        self.step_grads.release()
        if not skipped and not self._refreshed:
            self._refresh_compute()   # torch.optim stepped the masters
        # [Note: no deferred gathers] The updated rows are all-gathered (units overlapping
        # one another) before step() returns: parameters are current whenever the user
        # looks, and no collective outlives the call, so none can outlive the process group.
        self.comm.drain()
        self.comm.end_step()
        if self.replicas is not None:
            self.replicas.end_step()
        if self.placement is not None and not skipped:
            self.placement.after_step()     # ratio="auto", once: placement.py
        self.observers.step_done()

    def _host_grad_dtype(self, unit) -> torch.dtype:
        """Gradients land on the host in the reduce dtype when CPU Adam reads them (scaled
        fp16 too: it unscales as it reads, step.py's [Note: deferred scaling]); in the
        master dtype when torch.optim steps them."""
        precision = self.plan.precision
        if cpu_adam_steps(self.optimizer):
            return precision.reduce_dtype or unit.compute_dtype
        return unit.master_dtype
