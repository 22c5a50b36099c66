"""The parity part: zerofn against plain PyTorch on the same device, at worlds that share
it over gloo.

This is the one module of the check that imports from ``tests/support``: the parity
suite's model, batches, reference and sharded loops, and ``run_ranks``. Those are what
parity means in this project; a copy here would drift from the suite the GPU run is meant
to repeat, and zerofn itself carries no test code. ``tests/`` goes on sys.path only when
this part runs."""
from __future__ import annotations

import sys

from .catalog import LIMIT
from .paths import TESTS

TOL = 1e-5                     # parity, as tests/test_parity.py

# (stage, optimizer, micro-batches per step, options): every option of the parity matrix
# that differs on a device, with rows not divisible by 3.
PARITY_CONFIGS = [(1, "adamw", 2, {"clip": 0.05}), (2, "adamw", 2, {"clip": 0.05}),
                  (3, "adamw", 2, {"clip": 0.05}), (3, "sgd", 1, {}),
                  (2, "adamw", 1, {"offload": {}}),
                  (3, "adamw", 2, {"offload": {"params": True}, "clip": 0.05})]


def parity_rank(rank, world, device: str, configs) -> list[tuple[float, float]]:
    """Each config trained sharded over the world's gloo group on ``device`` (every rank on
    the same GPU for cuda) and as plain PyTorch on the same device: the largest
    differences of the full params and of the optimizer state."""
    import torch

    import zerofn as zf
    from support.loops import STAGES, train_reference, train_sharded
    from support.models import batches, make_models, make_optimizer
    if device == "cuda":
        torch.cuda.set_device(0)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    out = []
    for stage, kind, accum, opts in configs:
        ref, model = make_models()
        ref, model = ref.to(device), model.to(device)
        ref_opt = make_optimizer(kind, ref.parameters())
        opt = make_optimizer(kind, model.parameters())
        extra = [zf.offload("cpu", **opts["offload"])] if "offload" in opts else []
        model, opt = zf.compose(*(getattr(zf, n)() for n in STAGES[stage]), *extra)(model, opt)
        data = [[(x.to(device), y.to(device)) for x, y in micro]
                for micro in batches(3, accum, world)]
        train_reference(ref, ref_opt, data, opts.get("clip"))
        train_sharded(model, opt, data, rank, world, opts.get("clip"))
        out.append(_state_errors(ref, ref_opt, *zf.get_state_dict(model, opt, full=True)))
    return out


def _state_errors(ref, ref_opt, msd, osd) -> tuple[float, float]:
    import torch
    p_err = max((msd[k].cpu().float() - v.cpu().float()).abs().max().item()
                for k, v in ref.state_dict().items())
    names = {p: n for n, p in ref.named_parameters()}
    s_err = max(((osd["state"][names[p]][k].cpu() - v.cpu()).abs().max().item()
                 for p, st in ref_opt.state.items() for k, v in st.items()
                 if torch.is_tensor(v) and v.dim()), default=0.0)
    return p_err, s_err


def config_name(world: int, config) -> str:
    """``world 2, ZeRO-3 adamw x2 clip=0.05``: the world, then the config's stage, optimizer,
    micro-batches and options, where it has any."""
    stage, kind, accum, opts = config
    return " ".join([f"world {world}, ZeRO-{stage} {kind} x{accum}",
                     *(f"{k}={v}" for k, v in opts.items())])


def run_parity(worlds, device: str, configs=PARITY_CONFIGS, timeout: float = 600) -> dict:
    """Each world's ranks (killed after ``timeout`` seconds) against plain PyTorch."""
    if TESTS not in sys.path:
        sys.path.insert(0, TESTS)
    from support.ranks import run_ranks
    figures, lines, ok = {}, [], True
    for world in worlds:
        per_rank = run_ranks(world, parity_rank, device, configs, timeout=timeout)
        worst = [tuple(map(max, zip(*errs))) for errs in zip(*per_rank)]
        for config, (p_err, s_err) in zip(configs, worst):
            good = p_err < TOL and s_err < TOL
            ok &= good
            name = config_name(world, config)
            figures[name] = [p_err, s_err]
            lines.append(f"{'ok' if good else 'FAILS'} {name}: params {p_err:.2e}, "
                         f"optimizer state {s_err:.2e} (tolerance {TOL:g})")
    return dict(status="ok" if ok else "failed", figures=figures, lines=lines)


def part_parity(args) -> dict:
    return run_parity((2, 3), "cuda", timeout=LIMIT["parity"] / 2)
