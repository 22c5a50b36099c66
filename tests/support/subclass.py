"""Tensor subclasses of the kind float8 and NF4 weights are: ``__torch_dispatch__`` wrappers
whose values live in an inner tensor (``inner``).

``Wrapped`` has no FSDP2 all-gather hooks, ``PreHookOnly`` one of the two: zerofn refuses
such a parameter (core/units.py, ``hooks_of``). ``Int8Gathered`` has both
(``fsdp_pre_all_gather`` and ``fsdp_post_all_gather``) and changes what is gathered, as
float8 training's weights do: its rows travel as int8 codes with one fp32 scale per row,
and the gathered weight is their dequantized values, so a model trains on weights rounded
by the gather, under FSDP2 and zerofn alike. ``Int8Built`` gathers the same way and builds
its compute weight as a tensor subclass (``Dequantized``), as float8 training's post-hook
does. ``HOOK_CALLS`` counts the hooks' calls, by name."""
from __future__ import annotations

import gc
from collections import Counter

import torch
from torch.autograd.grad_mode import _unsafe_preserve_version_counter
from torch.utils._pytree import tree_map, tree_map_only

HOOK_CALLS: Counter = Counter()


class Wrapped(torch.Tensor):
    @staticmethod
    def __new__(cls, inner: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype,
                                                   device=inner.device)

    def __init__(self, inner: torch.Tensor):
        self.inner = inner

    def __tensor_flatten__(self):
        return ["inner"], None

    @staticmethod
    def __tensor_unflatten__(tensors, meta, *_):
        return Wrapped(tensors["inner"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        unwrap = lambda t: t.inner if isinstance(t, Wrapped) else t     # noqa: E731
        out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))
        # nn.Parameter needs detach() to keep the type.
        return cls(out) if func is torch.ops.aten.detach.default else out


class PreHookOnly(Wrapped):
    """Half of FSDP2's hooks: refused, as FSDP2 refuses it."""

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        return (self.inner,), None


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 codes of each row and the row's fp32 scale (its absolute max / 127)."""
    scale = (x.abs().amax(dim=1, keepdim=True).float() / 127).clamp(min=1e-12)
    return (x.float() / scale).round().clamp(-127, 127).to(torch.int8), scale


class _Holding(torch.Tensor):
    """A wrapper over one plain tensor (the attribute ``cls.held`` names), as float8's
    tensors are: every op runs on that tensor, and the ops ``cls.keeps`` gives the result
    wrapped again."""
    held = "inner"

    @staticmethod
    def __new__(cls, values: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(cls, values.shape, values.stride(),
                                                   values.storage_offset(), dtype=values.dtype,
                                                   device=values.device,
                                                   requires_grad=values.requires_grad)

    def __init__(self, values: torch.Tensor):
        setattr(self, self.held, values)

    def __repr__(self):
        return f"{type(self).__name__}({getattr(self, self.held)})"

    def __tensor_flatten__(self):
        return [self.held], None

    @classmethod
    def __tensor_unflatten__(cls, tensors, meta, outer_size, outer_stride):
        return cls(tensors[cls.held])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        values = lambda t: getattr(t, cls.held)      # noqa: E731
        out = func(*tree_map_only(cls, values, args), **tree_map_only(cls, values, kwargs or {}))
        return tree_map_only(torch.Tensor, cls, out) if cls.keeps(func) else out


class Int8Gathered(_Holding):
    """A weight kept in full precision (``inner``: what the optimizer steps) and gathered
    as int8 rows and their scales. Every op but the gather runs on ``inner``; the ops
    FSDP2's sharding and an optimizer's state need (chunk, view, zeros_like, copy_, ...)
    keep the subclass, as float8 training's weight wrapper does."""

    @staticmethod
    def keeps(func) -> bool:
        return func in _KEEPS

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        """This rank's rows as int8 codes and scales, padded to the even share of
        ``outer_size``'s rows (a rank with fewer rows sends zero rows)."""
        HOOK_CALLS["pre"] += 1
        rows = -(-outer_size[0] // mesh.size())
        padded = self.inner.new_zeros((rows,) + tuple(outer_size[1:]))
        padded[:self.inner.shape[0]].copy_(self.inner)
        codes, scale = quantize_rows(padded.reshape(rows, -1))
        return (codes.view(padded.shape), scale), None

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        """The dequantized weight, in ``param_dtype``: the tensor the forward uses."""
        HOOK_CALLS["post"] += 1
        codes, scale = all_gather_outputs
        weight = (codes.reshape(codes.shape[0], -1).float() * scale).view(codes.shape)
        weight = weight.to(param_dtype)
        if out is not None:      # FSDP2 rebuilding into the tensor it made the first time
            with torch.no_grad(), _unsafe_preserve_version_counter(out):   # (saved by autograd)
                out.copy_(weight)
            return None
        return weight, (weight,)


class Int8Unpadded(Int8Gathered):
    """Gathers a short shard unpadded: the ranks' gathers would not match (refused)."""

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        return quantize_rows(self.inner), None


class Dequantized(_Holding):
    """The weight ``Int8Built``'s post-hook builds: a tensor subclass over the dequantized
    values (``weight``), as float8 training's ``Float8TrainingTensor`` is one over float8
    bytes. Views stay ``Dequantized`` (a Linear's ``weight.t()``, FSDP2's ``as_strided`` and
    ``nn.Parameter``); every other op runs on the values and gives plain tensors, its
    gradient among them."""
    held = "weight"

    @staticmethod
    def keeps(func) -> bool:
        return func in _VIEWS


class Contagious(Dequantized):
    """A ``Dequantized`` every op's result stays, its gradient too: refused in backward."""

    @staticmethod
    def keeps(func) -> bool:
        return True


class Int8Built(Int8Gathered):
    """Gathered as ``Int8Gathered``, its compute weight built as a ``Dequantized`` tensor
    subclass, as float8 training's is (FSDP2 rebuilds it in place: ``out``)."""

    built = Dequantized

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        weight, _ = super().fsdp_post_all_gather(all_gather_outputs, metadata, param_dtype)
        if out is not None:
            with torch.no_grad(), _unsafe_preserve_version_counter(out.weight):
                out.weight.copy_(weight)
            return None
        return self.built(weight), (weight,)


class Int8Flat(Int8Built):
    """Builds its compute weight flattened: not the parameter's shape (refused)."""

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        built, inner = super().fsdp_post_all_gather(all_gather_outputs, metadata, param_dtype)
        return Dequantized(built.weight.flatten()), inner


class Int8Contagious(Int8Built):
    """Builds a ``Contagious`` compute weight: its gradient comes back a subclass."""

    built = Contagious


def computed_with(module, seen: list):
    """A forward pre-hook on ``module`` (registered after zerofn's, so it runs once the
    weight is gathered): what its forward computes with goes into ``seen``, as ``[the
    weight's type name, whether the storage of a subclass's first inner tensor outlived
    the forward]`` (autograd keeping it until backward), the latter filled in by ``look``,
    which ``train`` calls between forward and backward. Returns (handle, look)."""
    def hook(module, args):
        w = module.weight
        ref = None
        if type(w) not in (torch.Tensor, torch.nn.Parameter):
            ref = getattr(w, w.__tensor_flatten__()[0][0]).untyped_storage()._weak_ref()
        seen.append([type(w).__name__, ref])

    def look():
        gc.collect()
        ref = seen[-1][1]
        seen[-1][1] = ref is not None and not torch.UntypedStorage._expired(ref)
        if ref is not None:
            torch.UntypedStorage._free_weak_ref(ref)

    return module.register_forward_pre_hook(hook), look


_aten = torch.ops.aten
_KEEPS = {_aten.detach.default, _aten.alias.default, _aten.clone.default, _aten.view.default,
          _aten._unsafe_view.default, _aten.split.Tensor, _aten.split_with_sizes.default,
          _aten.chunk.default, _aten.slice.Tensor, _aten.narrow.default,
          _aten.as_strided.default, _aten.new_zeros.default, _aten.new_empty.default,
          _aten.empty_like.default, _aten.zeros_like.default, _aten.copy_.default,
          _aten._to_copy.default, _aten.zero_.default, _aten.t.default}
_VIEWS = {_aten.detach.default, _aten.alias.default, _aten.view.default, _aten.t.default,
          _aten.transpose.int, _aten.as_strided.default, _aten._unsafe_view.default}
