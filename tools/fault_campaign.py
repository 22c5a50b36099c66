"""Faults, counted (docs/checkpoints.md, "Faults, counted"): each fault at random instants
drawn from ``--seed``, every trial printed with the line that replays it, and one row of
the table per fault.

    OMP_NUM_THREADS=1 python tools/fault_campaign.py all --trials 100 --seed 0
    OMP_NUM_THREADS=1 python tools/fault_campaign.py kill-sync --trials 100 --seed 0
    python tools/fault_campaign.py kill-async --replay "world=2 stage=3 offload=cpu ..."

Rows (each a subcommand; ``all`` runs them in this order):

- ``kill-sync``, ``kill-async``: a small GPT trains ``STEPS`` steps at world 1 or 2, every
  stage, with and without offload("cpu"), saving after each step; at a drawn save one rank
  or every rank is SIGKILLed at a drawn instant after the save began (0 to 1.5 times what
  that save takes uninterrupted). Fresh ranks then load the newest complete checkpoint
  and train to the end: survived where that run's model and optimizer state equal the
  uninterrupted run's bit for bit; data is lost where a checkpoint complete before the
  kill no longer loads, or the state differs.
- ``full-disk``: the checkpoint root on a tmpfs mounted for the run (root only), one
  checkpoint saved, the drive then filled to a drawn number of free bytes below the next
  checkpoint's size, and the next save (sync or async) made: caught where every rank
  raises; then the previous checkpoint still loads, and once space is freed the same
  ranks save again and that checkpoint loads to the uninterrupted run's state.
- ``full-swap``: NVMe offload's swap files on such a tmpfs, filled to a drawn share of
  what every rank's swap files take: caught where every rank's set-up raises (set-up
  reserves the files' space, so no later swap write can find the drive full; ranks sharing
  the drive may each see room for its own file but not for both); then, the space freed,
  the same ranks train to the run's reference state.
- ``corrupt``: one bit flipped at a drawn offset, or a drawn truncation, in a drawn file of
  a complete checkpoint: caught where every rank's load raises.
- ``nonfinite``: nan, inf or -inf in one rank's loss or in one parameter's gradient rows at
  a drawn step, under fp32, bf16 and fp16 (a third of the trials each), with
  ``on_nonfinite`` "skip" or "raise" (fp16: its scaler's skip): caught where every rank
  skipped the step with the state unchanged, or every rank raised NonFiniteGradient
  naming the step.

Ranks are forked from this process over gloo (no GPU needed). The configuration of each
trial and its instant come from one ``random.Random(seed)``: the same command draws the
same trials.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import pickle
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import torch
import torch.distributed as dist

import zerofn as zf
from zerofn.nanogpt import GPT, GPTConfig
from zerofn.runtime import runtime_of

CFG = GPTConfig(vocab=64, width=32, heads=2, ffn=64, layers=2, context=16)
STEPS = 4
PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


# -- ranks ------------------------------------------------------------------------------------
def on_ranks(world: int, fn, *args, timeout: float = 120, grace: float = 0.5) -> dict:
    """``fn(rank, world, *args)`` on ``world`` ranks forked from here over gloo. Returns
    each rank's ("ok", value), ("error", text) or ("killed", None). Once a rank is
    killed, the others get ``grace`` seconds, then are killed too, as torchrun would."""
    store = tempfile.mktemp(prefix="zerofn-fault-store-")
    procs = {}
    for rank in range(world):
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(read)
            _child(store, rank, world, fn, args, write)
        os.close(write)
        procs[rank] = (pid, read)
    out, killed_at, deadline = {}, None, time.monotonic() + timeout
    while len(out) < world:
        for rank, (pid, read) in procs.items():
            if rank in out:
                continue
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                data = b"".join(iter(lambda r=read: os.read(r, 1 << 16), b""))
                os.close(read)
                out[rank] = pickle.loads(data) if data else ("killed", None)
                if os.WIFSIGNALED(status) and killed_at is None:
                    killed_at = time.monotonic()
        now = time.monotonic()
        if (killed_at is not None and now > killed_at + grace) or now > deadline:
            for rank, (pid, _) in procs.items():
                if rank not in out:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
        time.sleep(0.005)
    with contextlib.suppress(FileNotFoundError):
        os.remove(store)
    return out


def _child(store, rank, world, fn, args, write) -> None:
    try:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                                world_size=world)
        result = ("ok", fn(rank, world, *args))
    except BaseException as e:      # noqa: BLE001 (reported, whatever it is)
        result = ("error", f"{type(e).__name__}: {e}")
    with os.fdopen(write, "wb") as f:
        f.write(pickle.dumps(result))
    os._exit(0)


# -- the job ----------------------------------------------------------------------------------
def build(stage: int, offload: str | None, precision: str = "fp32", offload_path=None,
          **sharding):
    torch.manual_seed(0)
    model = GPT(CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    transforms = [zf.shard_optimizer(**sharding)] + [zf.shard_grads()] * (stage >= 2) + \
        [zf.shard_params()] * (stage == 3)
    if PRECISIONS[precision] is not None:
        scaling = {"initial_scale_power": 8, "hysteresis": 1} if precision == "fp16" else {}
        transforms.append(zf.mixed_precision(PRECISIONS[precision], **scaling))
    if offload_path is not None:
        transforms.append(zf.offload("nvme", path=offload_path))
    elif offload:
        transforms.append(zf.offload(offload))
    return zf.compose(*transforms)(model, opt)


def train_step(model, opt, step: int, rank: int, world: int, poison=None) -> None:
    """Step ``step`` (from 0) on this rank's rows of that step's batch; ``poison``:
    ("loss" or "grad", value) put into this rank's loss, or the first gradient row of the
    first block's fc weight."""
    g = torch.Generator().manual_seed(step)
    x = torch.randint(0, CFG.vocab, (2 * world, CFG.context), generator=g).chunk(world)[rank]
    loss = model(x, x)
    if poison and poison[0] == "loss":
        loss = loss * poison[1]
    zf.scale_loss(model, loss).backward()
    if poison and poison[0] == "grad":
        local = model.blocks[0].fc.weight.grad.to_local().view(-1)
        if local.numel():
            local[0] = poison[1]
    opt.step()
    opt.zero_grad()


def digest(model, opt) -> str:
    """The model's and optimizer's full state, hashed (the same on every rank)."""
    msd, osd = zf.get_state_dict(model, opt, full=True)
    h = hashlib.sha256()
    for k in sorted(msd):
        h.update(k.encode() + _bytes(msd[k]))
    for fqn in sorted(osd["state"]):
        for k, v in sorted(osd["state"][fqn].items()):
            h.update(f"{fqn}.{k}".encode() + _bytes(torch.as_tensor(v)))
    return h.hexdigest()


def _bytes(t: torch.Tensor) -> bytes:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def save(root, model, opt, step: int, mode: str) -> None:
    zf.save_checkpoint(root, model, opt, step=step, async_save=mode == "async")
    if mode == "async":
        zf.wait_for_checkpoint()


# -- kill during a save -----------------------------------------------------------------------
def uninterrupted(rank, world, stage, offload, mode, root):
    """The run with no fault: each save's duration, and the final state's digest."""
    model, opt = build(stage, offload)
    took = []
    for step in range(STEPS):
        train_step(model, opt, step, rank, world)
        start = time.perf_counter()
        save(root, model, opt, step + 1, mode)
        took.append(time.perf_counter() - start)
    return took, digest(model, opt)


def killed_in_save(rank, world, stage, offload, mode, root, at, delay, victims):
    """Train and save; the save after step ``at`` is cut off: the victims SIGKILL
    themselves ``delay`` seconds after it began. Marks each rank's save that finished."""
    model, opt = build(stage, offload)
    for step in range(at):
        train_step(model, opt, step, rank, world)
        if step + 1 == at and (victims == "all" or rank == world - 1):
            threading.Timer(delay, os.kill, (os.getpid(), signal.SIGKILL)).start()
        save(root, model, opt, step + 1, mode)
    open(os.path.join(root, f"finished-{rank}"), "w").close()
    time.sleep(60)       # killed here, as a job is once one of its ranks died


def resumed(rank, world, stage, offload, root):
    """Fresh ranks: the newest complete checkpoint loaded, the run finished."""
    model, opt = build(stage, offload)
    got = zf.load_checkpoint(root, model, opt)
    start = got["step"] if got else 0
    for step in range(start, STEPS):
        train_step(model, opt, step, rank, world)
    return start, digest(model, opt)


def kill_trial(trial: dict, references: dict) -> tuple[bool, bool, str]:
    """One kill: (survived, data lost, what happened)."""
    key = (trial["world"], trial["stage"], trial["offload"], trial["mode"])
    with tempfile.TemporaryDirectory() as root:
        if key not in references:
            out = on_ranks(trial["world"], uninterrupted, *key[1:], os.path.join(root, "ref"))
            references[key] = _only(out)
        took, expected = references[key]
        ckpt = os.path.join(root, "ckpt")
        delay = trial["frac"] * 1.5 * took[trial["at"] - 1]
        on_ranks(trial["world"], killed_in_save, trial["stage"], trial["offload"],
                 trial["mode"], ckpt, trial["at"], delay, trial["victims"])
        finished = all(os.path.exists(os.path.join(ckpt, f"finished-{r}"))
                       for r in range(trial["world"]))
        out = on_ranks(trial["world"], resumed, trial["stage"], trial["offload"], ckpt)
    if any(kind != "ok" for kind, _ in out.values()):
        return False, True, f"resume failed: {out}"
    start, got = out[0][1]
    lost = start < trial["at"] - 1 or (finished and start < trial["at"])
    survived = got == expected and not lost
    when = "after the save finished" if finished else "during the save"
    return survived, lost or got != expected, \
        f"killed {when} (delay {delay * 1e3:.1f} ms), resumed from step {start}: " + \
        ("same state" if got == expected else "STATE DIFFERS")


def draw_kill(rng: random.Random, mode: str) -> dict:
    world = rng.choice([1, 2])
    return dict(world=world, stage=rng.choice([1, 2, 3]), offload=rng.choice([None, "cpu"]),
                mode=mode, victims="all" if world == 1 else rng.choice(["one", "all"]),
                at=rng.randint(1, STEPS - 1), frac=round(rng.random(), 4))


# -- corrupt files ----------------------------------------------------------------------------
def saved_once(rank, world, root):
    model, opt = build(2, None)
    train_step(model, opt, 0, rank, world)
    save(root, model, opt, 1, "sync")


def load_only(rank, world, root):
    model, opt = build(2, None)
    return zf.load_checkpoint(root, model, opt)["step"]


def corrupt_trial(trial: dict, sources: dict) -> tuple[bool, bool, str]:
    with tempfile.TemporaryDirectory() as root:
        world = trial["world"]
        if world not in sources:
            sources[world] = tempfile.mkdtemp(prefix="zerofn-fault-source-")
            _only(on_ranks(world, saved_once, sources[world]))
        shutil.copytree(sources[world], root, dirs_exist_ok=True)
        step_dir = os.path.join(root, next(d for d in os.listdir(root) if d.startswith("step-")))
        files = sorted(f for f in os.listdir(step_dir) if os.path.isfile(os.path.join(step_dir, f)))
        name = files[trial["file"] % len(files)]
        path = os.path.join(step_dir, name)
        size = os.path.getsize(path)
        at = int(trial["where"] * size)
        if trial["fault"] == "flip":
            with open(path, "r+b") as f:
                f.seek(min(at, size - 1))
                byte = f.read(1)[0]
                f.seek(min(at, size - 1))
                f.write(bytes([byte ^ (1 << trial["bit"])]))
        else:
            os.truncate(path, min(at, size - 1))
        out = on_ranks(world, load_only, root)
    caught = all(kind == "error" for kind, _ in out.values())
    what = f"{trial['fault']} in {name} at {at} of {size} bytes: " + \
        ("caught on every rank: " + out[0][1][:150] if caught else f"NOT CAUGHT: {out}")
    return caught, False, what


def draw_corrupt(rng: random.Random) -> dict:
    return dict(world=rng.choice([1, 2]), fault=rng.choice(["flip", "truncate"]),
                file=rng.randrange(1000), where=round(rng.random(), 4), bit=rng.randrange(8))


# -- non-finite values ------------------------------------------------------------------------
def poisoned(rank, world, stage, precision, rule, at, where, value, victim):
    """The run up to step ``at`` (from 0), which is poisoned on rank ``victim``: whether
    each rank skipped it with the state unchanged, or what it raised."""
    sharding = {} if rule == "scaler" else {"on_nonfinite": rule}
    model, opt = build(stage, None, precision, **sharding)
    for step in range(at):
        train_step(model, opt, step, rank, world)
    before = digest(model, opt)
    try:
        train_step(model, opt, at, rank, world, (where, value) if rank == victim else None)
    except zf.NonFiniteGradient as e:
        return "raised", str(e), before == digest(model, opt)
    return "skipped" if runtime_of(model).step_skipped() else "taken", "", \
        before == digest(model, opt)


def nonfinite_trial(trial: dict, _) -> tuple[bool, bool, str]:
    out = on_ranks(trial["world"], poisoned, trial["stage"], trial["precision"], trial["rule"],
                   trial["at"], trial["where"], trial["value"], trial["victim"])
    results = [value for kind, value in out.values() if kind == "ok"]
    expected = "raised" if trial["rule"] == "raise" else "skipped"
    caught = len(results) == trial["world"] and all(
        r[0] == expected and r[2] and (expected == "skipped" or f"step {trial['at'] + 1}" in r[1])
        for r in results)
    return caught, False, (f"every rank {expected}, state unchanged" if caught
                           else f"NOT CAUGHT: {out}")


def draw_nonfinite(rng: random.Random, index: int) -> dict:
    precision = ("fp32", "bf16", "fp16")[index % 3]
    world = rng.choice([1, 2])
    where = rng.choice(["loss", "grad"])
    if where == "grad" and precision == "fp16":
        where = "loss"        # (fp16 rows are scaled: a planted value is the loss's job)
    return dict(world=world, stage=rng.choice([1, 2, 3]), precision=precision,
                rule="scaler" if precision == "fp16" else rng.choice(["skip", "raise"]),
                at=rng.randint(1, STEPS - 1), where=where, victim=rng.randrange(world),
                value=rng.choice([float("nan"), float("inf"), float("-inf")]))


# -- a full disk during a save ----------------------------------------------------------------
@contextlib.contextmanager
def small_drive(size: int):
    """A tmpfs of ``size`` bytes mounted for the run (needs root), or None where it cannot be."""
    path = tempfile.mkdtemp(prefix="zerofn-full-disk-")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", path],
                             capture_output=True).returncode == 0
    try:
        yield path if mounted else None
    finally:
        if mounted:
            subprocess.run(["umount", path], check=False)
        os.rmdir(path)


def filled(path: str, free: int, rank: int) -> str:
    """Rank 0 fills ``path``'s drive to ``free`` bytes; every rank waits. The filler's path."""
    filler = os.path.join(path, "filler")
    if rank == 0:
        avail = os.statvfs(path).f_bavail * os.statvfs(path).f_frsize
        with open(filler, "wb") as f:
            f.write(b"\0" * max(0, avail - free))
    dist.barrier()
    return filler


def save_on_full_disk(rank, world, stage, mode, root, free):
    """One checkpoint saved, the drive filled to ``free`` bytes, the next save made: what
    it raised; then space freed, the save made again."""
    model, opt = build(stage, None)
    train_step(model, opt, 0, rank, world)
    save(root, model, opt, 1, mode)
    train_step(model, opt, 1, rank, world)
    dist.barrier()
    filler = filled(root, free, rank)
    try:
        save(root, model, opt, 2, mode)
        raised = None
    except Exception as e:       # noqa: BLE001 (what it is, is the finding)
        raised = f"{type(e).__name__}: {e}"
    if rank == 0:
        os.remove(filler)
    dist.barrier()
    if raised is not None:        # the run saves again once space is freed
        save(root, model, opt, 2, mode)
    return raised, digest(model, opt)


def full_disk_trial(trial: dict, references: dict) -> tuple[bool, bool, str]:
    with small_drive(8 << 20) as drive:
        if drive is None:
            return False, False, "SKIPPED: mount -t tmpfs needs root"
        root = os.path.join(drive, "ckpt")
        out = on_ranks(trial["world"], save_on_full_disk, trial["stage"], trial["mode"], root,
                       trial["free"])
        results = [value for kind, value in out.values() if kind == "ok"]
        if len(results) != trial["world"]:
            return False, True, f"a rank failed beyond the save: {out}"
        caught = all(r[0] is not None for r in results)
        later = on_ranks(trial["world"], resumed_to, trial["stage"], root, 2)
    same = all(kind == "ok" and value == results[0][1] for kind, value in later.values())
    return caught and same, not same, \
        (f"free {trial['free']} bytes: " + (f"every rank raised ({results[0][0][:120]})"
                                            if caught else "NOT CAUGHT on every rank")
         + ("; saved again once freed, and it loads to the same state" if same
            else "; THE STATE SAVED AFTERWARDS DIFFERS"))


def resumed_to(rank, world, stage, root, step):
    model, opt = build(stage, None)
    got = zf.load_checkpoint(root, model, opt)
    assert got["step"] == step, got
    return digest(model, opt)


def draw_full_disk(rng: random.Random) -> dict:
    return dict(world=rng.choice([1, 2]), stage=rng.choice([1, 2, 3]),
                mode=rng.choice(["sync", "async"]), free=rng.randrange(0, 200_000))


# -- a full disk under NVMe offload's swap files -------------------------------------------------
def swap_on_full_disk(rank, world, stage, drive, free):
    """The drive filled to ``free`` bytes, a model offloaded to NVMe there: what its set-up
    raised (set-up checks the drive's free space and reserves the swap files' with
    fallocate, so no later swap write can find the drive full); then the space freed, the
    same model built again and trained: its digest."""
    filler = filled(drive, free, rank)
    try:
        build(stage, None, offload_path=drive)
        raised = None
    except Exception as e:       # noqa: BLE001 (what it is, is the finding)
        raised = f"{type(e).__name__}: {e}"
    dist.barrier()
    if rank == 0:
        os.remove(filler)
    dist.barrier()
    return raised, trained_on_nvme(rank, world, stage, drive)


def swap_trial(trial: dict, references: dict) -> tuple[bool, bool, str]:
    key = (trial["world"], trial["stage"])
    if key not in references:    # the same run with its swap files on a roomy drive
        with tempfile.TemporaryDirectory() as roomy:
            references[key] = _only(on_ranks(trial["world"], swap_reference, trial["stage"],
                                             roomy))
    want, needed = references[key]
    free = int(trial["share"] * needed)      # short of what the swap files take
    with small_drive(8 << 20) as drive:
        if drive is None:
            return False, False, "SKIPPED: mount -t tmpfs needs root"
        out = on_ranks(trial["world"], swap_on_full_disk, trial["stage"], drive, free)
    results = [value for kind, value in out.values() if kind == "ok"]
    if len(results) != trial["world"]:
        return False, True, f"a rank failed beyond the set-up: {out}"
    caught = all(r[0] is not None and drive in r[0] and "free" in r[0] for r in results)
    same = all(r[1] == want for r in results)
    return caught and same, not same, \
        (f"free {free:,} of the {needed:,} bytes needed: " + (f"every rank raised ({results[0][0][:120]})"
                                              if caught else f"NOT CAUGHT on every rank: "
                                              f"{[r[0] for r in results]}")
         + ("; once freed, the run trains to the reference state" if same
            else "; THE RUN AFTERWARDS DIFFERS"))


def swap_reference(rank, world, stage, drive):
    """The run's digest, and the bytes every rank's swap files take on the drive."""
    return trained_on_nvme(rank, world, stage, drive, measure=True)


def trained_on_nvme(rank, world, stage, drive, measure: bool = False):
    """The run with its swap files on ``drive``: its digest (and, with ``measure``, the
    bytes every rank's swap files take there)."""
    model, opt = build(stage, None, offload_path=drive)
    dist.barrier()
    used = sum(os.stat(os.path.join(drive, f)).st_blocks * 512 for f in os.listdir(drive))
    for step in range(STEPS):
        train_step(model, opt, step, rank, world)
    return (digest(model, opt), used) if measure else digest(model, opt)


def draw_swap(rng: random.Random) -> dict:
    return dict(world=rng.choice([1, 2]), stage=rng.choice([1, 2, 3]),
                share=round(rng.uniform(0, 0.95), 3))


# -- the campaign -----------------------------------------------------------------------------
ROWS = {   # command: (the table's name for it, draw(rng, index), trial(trial, cache))
    "kill-sync": ("kill during sync save", lambda rng, i: draw_kill(rng, "sync"), kill_trial),
    "kill-async": ("kill during async save", lambda rng, i: draw_kill(rng, "async"),
                   kill_trial),
    "full-disk": ("full disk during save", lambda rng, i: draw_full_disk(rng), full_disk_trial),
    "full-swap": ("full disk under NVMe swap files", lambda rng, i: draw_swap(rng),
                  swap_trial),
    "corrupt": ("flipped bit / truncated file", lambda rng, i: draw_corrupt(rng),
                corrupt_trial),
    "nonfinite": ("NaN / inf (fp32, bf16, fp16)", draw_nonfinite, nonfinite_trial),
}


def _only(out: dict):
    bad = {r: v for r, (kind, v) in out.items() if kind != "ok"}
    if bad:
        raise RuntimeError(f"an uninterrupted run failed: {bad}")
    return out[0][1]


def replay_line(row: str, trial: dict) -> str:
    return f"python tools/fault_campaign.py {row} --replay \"" + \
        " ".join(f"{k}={v}" for k, v in trial.items()) + "\""


def parse_replay(text: str) -> dict:
    out = {}
    for part in text.split():
        key, value = part.split("=", 1)
        for kind in (int, float):
            with contextlib.suppress(ValueError):
                value = kind(value)
                break
        out[key] = None if value == "None" else value
    return out


def run_row(row: str, trials: list[dict]) -> dict:
    name, _, trial_fn = ROWS[row]
    cache: dict = {}
    counts = {"trials": 0, "ok": 0, "lost": 0, "skipped": 0}
    start = time.perf_counter()
    for i, trial in enumerate(trials):
        ok, lost, what = trial_fn(trial, cache)
        skipped = what.startswith("SKIPPED")
        counts["skipped" if skipped else "trials"] += 1
        counts["ok"] += ok
        counts["lost"] += lost
        print(f"[{row} {i + 1}/{len(trials)}] {'ok' if ok else 'SKIP' if skipped else 'FAIL'}: "
              f"{what}\n    replay: {replay_line(row, trial)}", flush=True)
    counts["seconds"] = time.perf_counter() - start
    counts["name"] = name
    return counts


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("row", choices=sorted(ROWS) + ["all"])
    p.add_argument("--trials", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--replay", help="one trial, as a replay line prints it")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    rows = list(ROWS) if args.row == "all" else [args.row]
    table = []
    for row in rows:
        if args.replay:
            trials = [parse_replay(args.replay)]
        else:
            rng = random.Random(f"{args.seed}:{row}")
            trials = [ROWS[row][1](rng, i) for i in range(args.trials)]
        table.append(run_row(row, trials))
    print("\n| fault | trials | caught or survived | data lost | seconds |\n|---|---|---|---|---|")
    for c in table:
        trials = f"{c['trials']}" + (f" ({c['skipped']} skipped: no tmpfs)" if c["skipped"] else "")
        print(f"| {c['name']} | {trials} | {c['ok']} | {c['lost']} | {c['seconds']:.0f} |")
    print(f"(seed {args.seed}: python tools/fault_campaign.py {args.row} --trials "
          f"{args.trials} --seed {args.seed})")
    return 0 if all(c["ok"] == c["trials"] and not c["lost"] for c in table) else 1


if __name__ == "__main__":
    sys.exit(main())
