"""A runtime's optimizer step: what runs around the user's ``optimizer.step()``.

``before_step`` (the optimizer's step pre-hook) takes the step's one vote, then each unit's
home steps its rows (homes.step: the device's with the user's optimizer, the host's with
zerofn's CPU Adam, the swap file's streamed), each unit's updated rows sent back to the
compute parameters as soon as the unit is done; the user's own ``step()`` then finds no
gradient left and does nothing. ``after_step`` (the post-hook) updates the loss scale,
waits for the updated rows' all-gathers, and places ratio="auto"'s units once. Both are
torch's own step hooks on the optimizer, registered when it is bound (optimizer.py).
"""
from __future__ import annotations

import torch

from ..core.plan import Plan
from .clip import clip_grads
from .overlap import EarlySteps
from .optimizer import OptimizerBinding
from .owned import OwnedStep
from .placement import AutoPlacement
from .precision import LossScaler
from .step_grads import StepGrads


class Stepper:
    """The step's parts and the two step hooks (see the module note): the step's
    gradients and verdict (``grads``), fp16's loss ``scaler``, and, once an optimizer is
    bound (``bind``), ratio="auto"'s ``placement`` and the binding of the optimizer
    (``binding``), whose step hooks call ``before_step`` and ``after_step``.

    Args:
        homes: the units' homes, which step their rows (homes/).
        shards: refreshes compute rows from the updated masters (shards.py).
        reducer: whose shards the gradients are, with the step's landing (grads.py).
        gatherer: ZeRO-3's (params.py), whose unused gathers the step discards, or None.
    """

    def __init__(self, ctx, homes, shards, reducer, gatherer=None):
        self.ctx, self.homes, self.shards, self.gatherer = ctx, homes, shards, gatherer
        self.scaler = loss_scaler(ctx.plan)
        self.grads = StepGrads(ctx, reducer, reducer.landing, self.scaler, homes)
        self.early = reducer.landing.early
        self.reducer = reducer
        self.optimizer = None
        self.owned: OwnedStep | None = None     # whole-tensor optimizers' parameters
        self.binding: OptimizerBinding | None = None
        self.placement: AutoPlacement | None = None
        self._stepped = False    # the homes stepped this step (not skipped)
        self._changed = [u for u in ctx.units if u.slots]    # what a step changes, found once

    def bind(self, optimizer, slot_of: dict) -> None:
        """Step with ``optimizer`` from now on (its problems were agreed on already): its
        groups hold the shards first, then the homes give it their state."""
        self.owned = OwnedStep(self.ctx, optimizer, slot_of, self.shards, self.reducer)
        self.binding = OptimizerBinding(optimizer, slot_of, self, self.ctx,
                                        {s for _, s in self.owned.slots})
        self.owned.adopt_state()    # (state the optimizer had is cut to rows, as every rank's)
        self.homes.bind(optimizer)
        self.optimizer = optimizer
        # [Note: placing by the first step] (placement.py)
        if self.ctx.plan.offload.ratio == "auto" and self.ctx.plan.offload.device:
            self.placement = AutoPlacement(self.ctx, self.homes, optimizer)

    def before_step(self) -> None:
        skip = self.grads.settle()
        self.shards.settle_copies()   # the step rewrites host rows the last copies read
        if self.gatherer is not None:
            # A gather prefetched by a forward that raised (or evaluated without backward)
            # holds the shards as they were: the next forward must gather the stepped ones.
            self.gatherer.discard_pending()
        self._stepped = not skip
        # [Note: zero_grad without a patch] (optimizer.py): the optimizer, run by a home
        # below and by its own step next, must find no gradient but those zerofn gives it.
        self.reducer.visible.unmark()
        if not skip:
            # A background save copies aside (or first writes) what the step changes.
            self.ctx.saves.before_change(self._changed, self.ctx.timing)
            # Each unit's updated rows head back as soon as its home is done with it,
            # overlapping the step of the next one; a home that steps with zerofn's CPU
            # Adam unscales and clips the gradients as it reads them. Memory a home reuses
            # within the step (the host ring, NVMe's staging ring) waits for those copies.
            # Whole-tensor optimizers first (owned.py): their masters' rows are updated
            # before the homes send each unit's rows on; the homes step the rest.
            self.owned.step(self.grads.grads, self.grads.grad_scale)
            # (without the gradients reduced whole to owners: no rows of theirs to step)
            rows = {s: g for s, g in self.grads.grads.items()
                    if not self.reducer.to_its_owner(s)}
            self.homes.step(self.owned.elementwise, rows, self.shards.refresh_unit,
                            self.grads.grad_scale, self.ctx.copies, self.early)
            self.shards.await_shards()

    def after_step(self) -> None:
        skipped = self.grads.overflow
        if self.scaler is not None:
            self.scaler.update(skipped)
        self.grads.release()
        # [Note: no deferred gathers] The updated rows are all-gathered (units overlapping
        # one another) before step() returns: parameters are current whenever the user
        # looks, and no collective outlives the call, so none can outlive the process group.
        replicas = self.ctx.replicas
        for comm in self.ctx.comms:
            comm.drain()
            comm.end_step()
        if replicas is not None:
            replicas.end_step()
        if self.placement is not None and not skipped:
            self.placement.after_step()     # ratio="auto", once: placement.py
        self.grads.number += 1
        self.reducer.visible.mark()
        self.ctx.observers.step_done()

    def set_step(self, step: int) -> None:
        """The next optimizer step is number ``step`` (what the non-finite guard names)."""
        self.grads.number = step

    def follow_zero_grad(self) -> None:
        """At a forward: where the loop's ``zero_grad`` took the optimizer's markers off
        (optimizer.py's [Note: zero_grad without a patch]), the reduced rows start over:
        all of them, or the parameters it reached."""
        visible = self.reducer.visible
        cleared = visible.loop_cleared()
        if not cleared:
            return
        if cleared >= visible.marked():
            self.zero_grad()
        else:
            self.reducer.zero_rows(cleared)
            visible.forget(cleared)

    def zero_grad(self) -> None:
        """``optimizer.zero_grad()`` (and the model's): the reduced shards start over."""
        self.grads.release()
        self.reducer.zero_grad()

    def clip_grad_norm(self, max_norm: float, norm_type: float,
                       error_if_nonfinite: bool) -> torch.Tensor:
        """``zf.clip_grad_norm_`` (clip.py); the observers hear of the norm."""
        total = clip_grads(self.grads, max_norm, norm_type, error_if_nonfinite)
        self.ctx.observers.grad_norm(total)
        return total

    def restore(self) -> None:
        """Before undoing the binding: nothing of the step's stays."""
        self.grads.prepare()
        self.grads.release()


def loss_scaler(plan: Plan) -> LossScaler | None:
    """DeepSpeed's rule: dynamic scaling for fp16 unless a static scale is given."""
    p = plan.precision
    if not plan.scales_loss():
        return None
    if p.loss_scale is not None:
        return LossScaler(dynamic=False, scale=p.loss_scale)
    return LossScaler(dynamic=True, scale=2.0 ** p.initial_scale_power,
                      window=p.loss_scale_window, min_scale=p.min_loss_scale,
                      hysteresis=p.hysteresis, consecutive_hysteresis=p.consecutive_hysteresis)


def early_steps(ctx, homes, optimizer) -> EarlySteps | None:
    """``overlap_step``'s host steps during backward ([Note: the host step during
    backward], overlap.py), or None."""
    return EarlySteps(homes, optimizer, ctx) if ctx.plan.offload.overlap_step else None
