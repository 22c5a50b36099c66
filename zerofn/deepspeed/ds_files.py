"""A DeepSpeed checkpoint's files, read without DeepSpeed: which rank files one checkpoint
has (and whether they are all there), and their pickles unpickled safely.

DeepSpeed pickles some of its own objects (loss scalers, enums) into its files. They are
read by torch's weights-only unpickler, which runs no pickled code: each DeepSpeed class
gets an inert ``StandIn`` holding what the pickle held. Any other global a file names
beyond torch's weights-only defaults and the classes the user trusts
(``zerofn.trust_class``) is refused, naming the file, unless the conversion is
``trusted``: then it too gets a stand-in, and the value holding it is dropped.
"""
from __future__ import annotations

import os
import re

import torch

from ..io.checkpoint.pickles import StandIn, refusal, stand_in

_MODEL_FILE = re.compile(r"(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt$")
_OPTIM_FILE = re.compile(r"(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
# Pipeline stages save layer_NN[-model_MM]-model_states.pt; mixture-of-experts runs add
# layer_L_expert_E_mp_rank_MM_model_states.pt and expp_rank_R_mp_rank_MM_optim_states.pt.
_OTHER_PARALLEL = re.compile(r"(layer_\d+|expp_rank_\d+|.*expert_\d+).*\.pt$")
_DEEPSPEED = "deepspeed."


# -- reading pickles without DeepSpeed -------------------------------------------------
def load_file(path: str, key: str, trusted: bool = False) -> dict:
    """``torch.load`` with torch's restricted (weights-only) unpickler; every DeepSpeed
    global it does not allow (every global, when ``trusted``) is replaced by a ``StandIn``
    subclass of the same name, and any other raises ``ValueError``. The file must be a
    dict holding ``key``."""
    try:
        unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except Exception as e:  # any unreadable file is one clear error naming it
        raise ValueError(f"cannot read {path}: {type(e).__name__}: {e}") from e
    foreign = [name for name in unsafe if not name.startswith(_DEEPSPEED)]
    if foreign and not trusted:
        raise ValueError(refusal(path, sorted(foreign)))
    try:
        with torch.serialization.safe_globals([(stand_in(name), name) for name in unsafe]):
            data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # any unreadable file is one clear error naming it
        raise ValueError(f"cannot read {path}: {type(e).__name__}: {e}") from e
    if not isinstance(data, dict) or key not in data:
        raise ValueError(f"{path} is not a DeepSpeed checkpoint file (it has no {key!r}).")
    return data


def pickled_classes(obj) -> set[str]:
    """The paths of the classes stood in for anywhere inside ``obj``."""
    if isinstance(obj, StandIn):
        return {obj.path}
    if isinstance(obj, dict):
        return set().union(*(pickled_classes(k) | pickled_classes(v) for k, v in obj.items()))
    if isinstance(obj, (list, tuple, set, frozenset)):
        return set().union(*(pickled_classes(v) for v in obj))
    return set()


# -- finding the files -----------------------------------------------------------------
def find_step_dir(path, tag: str | None = None) -> str:
    """The directory holding one checkpoint's rank files (``global_stepN``)."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise ValueError(f"{path} is not a directory; pass the directory given to DeepSpeed's "
                         f"engine.save_checkpoint() or one of its global_step* directories.")
    if tag is not None:
        step_dir = os.path.join(path, tag)
        if not os.path.isdir(step_dir):
            raise ValueError(f"{path} has no checkpoint tagged {tag!r} (no directory {step_dir}).")
        return step_dir
    if any(_MODEL_FILE.match(n) or _OPTIM_FILE.match(n) for n in os.listdir(path)):
        return path
    latest = os.path.join(path, "latest")
    if os.path.isfile(latest):
        with open(latest) as f:
            tag = f.read().strip()
        step_dir = os.path.join(path, tag)
        if not os.path.isdir(step_dir):
            raise ValueError(f"{latest} names {tag!r}, but {step_dir} does not exist: the save "
                             f"did not finish or the directory was moved; pass --tag.")
        return step_dir
    raise ValueError(f"{path} is not a DeepSpeed checkpoint: it has neither a 'latest' file nor "
                     f"*_model_states.pt / *_optim_states.pt files. Pass the directory given "
                     f"to engine.save_checkpoint(), one of its global_step* directories, or "
                     f"the save dir with --tag.")


def rank_files(step_dir: str) -> tuple[dict, dict]:
    """``({dp_rank: model file}, {dp_rank: optimizer file})``; ZeRO-1/2 have one model file
    (rank 0's), ZeRO-3 one per rank."""
    names = sorted(os.listdir(step_dir))
    other = [n for n in names if _OTHER_PARALLEL.match(n)]
    if other:
        raise ValueError(f"{step_dir} holds pipeline-parallel or mixture-of-experts files "
                         f"({', '.join(other[:3])}); zerofn converts data-parallel ZeRO "
                         f"checkpoints only.")
    if "offloaded_tensors" in names:
        raise ValueError(f"{step_dir} keeps its optimizer state in offloaded_tensors/ "
                         f"(offload_optimizer to NVMe), not in the rank files; zerofn cannot "
                         f"convert it. Load it in DeepSpeed and save again without NVMe offload.")
    model, optim, mp_ranks = {}, {}, set()
    for name in names:
        for pattern, files in ((_MODEL_FILE, model), (_OPTIM_FILE, optim)):
            match = pattern.match(name)
            if match:
                mp_ranks.add(int(match.group(2)))
                files[int(match.group(1) or 0)] = os.path.join(step_dir, name)
    if mp_ranks - {0}:
        raise ValueError(f"{step_dir} holds model-parallel ranks mp_rank_"
                         f"{', mp_rank_'.join(f'{r:02d}' for r in sorted(mp_ranks))}: a tensor- "
                         f"or pipeline-parallel checkpoint. zerofn converts data-parallel ZeRO "
                         f"checkpoints (mp_rank_00 only); merge the model-parallel ranks first, "
                         f"e.g. with DeepSpeed's ds_to_universal.")
    if not model:
        raise ValueError(f"{step_dir} has no *_model_states.pt file: it is not a DeepSpeed "
                         f"checkpoint directory, or rank 0's model file is missing.")
    if not optim:
        raise ValueError(f"{step_dir} has no *_optim_states.pt files: it was saved without ZeRO "
                         f"(zero_optimization.stage 0), which zerofn does not convert, or the "
                         f"optimizer files are missing.")
    return model, optim


def check_ranks(ranks: set, world: int, what: str, files: dict) -> None:
    missing, extra = sorted(set(range(world)) - ranks), sorted(ranks - set(range(world)))
    where = os.path.dirname(next(iter(files.values())))
    if missing:
        raise ValueError(f"{where}: {what} files of data-parallel ranks {missing} are missing "
                         f"(found {len(ranks)} of the {world} the checkpoint was saved with); "
                         f"copy the complete directory.")
    if extra:
        raise ValueError(f"{where}: {what} files of ranks {extra} do not belong to a world of "
                         f"{world} (mismatched world sizes): the directory mixes files from "
                         f"different runs.")


def check_model_files(files: dict, stage: int, world: int, step_dir: str) -> None:
    if stage == 3:
        check_ranks(set(files), world, "model-state", files)
    elif 0 not in files or "zero_pp_rank" in os.path.basename(files[0]):
        raise ValueError(f"{step_dir}: a ZeRO-{stage} checkpoint needs mp_rank_00_model_states.pt, "
                         f"which is missing.")
