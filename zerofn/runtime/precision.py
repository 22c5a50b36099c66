"""fp16 loss scaling with DeepSpeed's semantics (static, or dynamic with hysteresis).

The scale the loss is multiplied by; after every optimizer step ``update(overflow)``:
an overflow skips the step, and either spends one unit of hysteresis or halves the scale
(never below ``min_scale``; at the minimum with hysteresis spent it is an error, as in
DeepSpeed). After ``window`` clean steps since the last overflow, the scale doubles.
"""
from __future__ import annotations


class LossScaler:
    def __init__(self, dynamic: bool, scale: float, window: int = 1000, min_scale: float = 1.0,
                 hysteresis: int = 2, consecutive_hysteresis: bool = False):
        self.dynamic = dynamic
        self.scale = float(scale)
        self.window = window
        self.min_scale = min_scale
        self.hysteresis = hysteresis
        self.consecutive_hysteresis = consecutive_hysteresis
        self.hysteresis_left = hysteresis
        self.iteration = 0
        self.last_overflow = -1

    def update(self, overflow: bool) -> None:
        if self.dynamic:
            self._overflowed() if overflow else self._clean()
        self.iteration += 1

    def _overflowed(self) -> None:
        if self.hysteresis == 1 or self.hysteresis_left == 1:
            if self.scale == self.min_scale:
                raise RuntimeError(
                    f"fp16 gradients overflowed at the minimum loss scale {self.min_scale}: "
                    "training has diverged. Lower the learning rate, or use bf16.")
            self.scale = max(self.scale / 2.0, self.min_scale)
        else:
            self.hysteresis_left -= 1
        self.last_overflow = self.iteration

    def _clean(self) -> None:
        if self.consecutive_hysteresis:
            self.hysteresis_left = self.hysteresis
        stable = self.iteration - self.last_overflow - 1
        if stable > 0 and stable % self.window == 0:
            if not self.consecutive_hysteresis:
                self.hysteresis_left = self.hysteresis
            self.scale *= 2.0

    _STATE = ("scale", "hysteresis_left", "iteration", "last_overflow")

    def state_dict(self) -> dict:
        return {k: getattr(self, k) for k in self._STATE}

    def load_state_dict(self, state: dict) -> None:
        for k in self._STATE:
            setattr(self, k, state[k])
