"""A data loader resumed at another world size reads the rest of its epoch once: saved part
way through an epoch at world 2, resumed at 1, 3 and 4, every row of the epoch is read
exactly once (counted), with torchdata's StatefulDistributedSampler and torch's
DistributedSampler; what cannot be placed over the new world is refused on every rank."""
from __future__ import annotations

import collections
import multiprocessing

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import zerofn as zf
from support.ranks import run_ranks
from support.shared_runs import shared
from zerofn.checkpoint import PerRank, ResumableLoader, load_checkpoint, save_checkpoint

StatefulDataLoader = pytest.importorskip("torchdata.stateful_dataloader").StatefulDataLoader
StatefulDistributedSampler = pytest.importorskip(
    "torchdata.stateful_dataloader.sampler").StatefulDistributedSampler

pytestmark = pytest.mark.multirank

ROWS = 240        # divides by 1, 2, 3 and 4: no padding at any of them
BATCH = 4         # rows a rank takes a batch
SEED = 3
EPOCH = 1         # the epoch saved part way through (not 0: the epoch must be kept too)
KINDS = ("torchdata", "torchdata-workers", "torchdata+torch-sampler", "torch")


class Rows(TensorDataset):
    """Row i is the number i."""

    def __init__(self, rows: int = ROWS):
        super().__init__(torch.arange(rows))


def allow_workers():
    """Ranks run as daemonic processes, which multiprocessing forbids to start the data
    loader's workers; a rank that needs them is marked otherwise (it ends them itself)."""
    multiprocessing.current_process()._config["daemon"] = False


def make_loader(kind: str, seed: int = SEED, rows: int = ROWS, sampler_class=None, **options):
    """(the loader a loop iterates, its sampler): each kind as a user builds it."""
    data = Rows(rows)
    if kind == "torch":
        sampler = (sampler_class or DistributedSampler)(data, shuffle=True, seed=seed)
        return ResumableLoader(DataLoader(data, batch_size=BATCH, sampler=sampler)), sampler
    if kind == "torchdata+torch-sampler":
        sampler = (sampler_class or DistributedSampler)(data, shuffle=True, seed=seed)
    else:
        sampler = (sampler_class or StatefulDistributedSampler)(data, shuffle=True, seed=seed)
    if kind == "torchdata-workers":
        allow_workers()
        # fork, as a rank torchrun starts on Linux does by default: these ranks come from a
        # forkserver, whose default would start a fresh server importing torch per worker
        options = {"num_workers": 2, "multiprocessing_context": "fork", **options}
    return StatefulDataLoader(data, batch_size=BATCH, sampler=sampler, **options), sampler


def as_extra(kind: str, loader):
    """A loader with workers has a state of its own on each rank (its workers' seeds drawn
    from the rank's generator): it is saved per rank."""
    return PerRank(loader) if getattr(loader, "num_workers", 0) else loader


def tiny():
    model = nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters())
    return zf.shard_optimizer()(model, opt)


def rows_of(batches) -> list[int]:
    return [i for (x,) in batches for i in x.tolist()]


def read(loader, batches: int) -> list[int]:
    it = iter(loader)
    return rows_of(next(it) for _ in range(batches))


def save_part(rank, world, root, kind, batches, **options):
    """Read ``batches`` batches of epoch EPOCH on every rank, save; the rows read."""
    model, opt = tiny()
    loader, sampler = make_loader(kind, **options)
    sampler.set_epoch(EPOCH)
    got = read(loader, batches)
    save_checkpoint(root, model, opt, step=batches, loader=as_extra(kind, loader), epoch=EPOCH)
    return got


def resume(rank, world, root, kind, then_batches=None, save_to=None):
    """Load, read the rest of the saved epoch (or ``then_batches`` of it, then save to
    ``save_to``), and the whole next epoch; (rows of the epoch, rows of the next)."""
    model, opt = tiny()
    loader, sampler = make_loader(kind)
    epoch = load_checkpoint(root, model, opt, loader=as_extra(kind, loader), epoch=None)["epoch"]
    sampler.set_epoch(epoch)
    if then_batches is not None:
        got = read(loader, then_batches)
        save_checkpoint(save_to, model, opt, step=100, loader=as_extra(kind, loader),
                        epoch=epoch)
        return got, []
    rest = rows_of(loader)
    sampler.set_epoch(epoch + 1)
    return rest, rows_of(loader)


def straight(rank, world, kind):
    """Epoch EPOCH read through at one go."""
    loader, sampler = make_loader(kind)
    sampler.set_epoch(EPOCH)
    return rows_of(loader)


def resume_and_straight(rank, world, root, kind):
    """``resume`` and ``straight`` in one launch: (its rest, its next epoch, the whole)."""
    return (*resume(rank, world, root, kind), straight(rank, world, kind))


def each(rank, world, calls):
    """Several rank functions in one launch: [fn(rank, world, *args) for fn, *args in calls]."""
    return [fn(rank, world, *args) for fn, *args in calls]


def epoch_rows(world: int, epoch: int) -> list[list[int]]:
    """Each rank's rows of a whole epoch at ``world``, as DistributedSampler deals them."""
    out = []
    for rank in range(world):
        sampler = DistributedSampler(Rows(), num_replicas=world, rank=rank, seed=SEED)
        sampler.set_epoch(epoch)
        out.append(list(sampler))
    return out


def counted(*parts) -> collections.Counter:
    return collections.Counter(i for part in parts for rows in part for i in rows)


@pytest.fixture(scope="module")
def saves(tmp_path_factory):
    """Each kind's world-2 checkpoint 3 batches into epoch EPOCH (24 of its 240 rows read),
    all saved in one launch: {kind: (its root, the rows each rank read)}."""
    top = tmp_path_factory.mktemp("saves")
    roots = {kind: str(top / kind) for kind in KINDS}
    read = run_ranks(2, each, [(save_part, roots[kind], kind, 3) for kind in KINDS])
    return {kind: (roots[kind], [rows[i] for rows in read]) for i, kind in enumerate(KINDS)}


def per_kind(kinds, ranks) -> dict:
    """each()'s per-rank lists of results, one a kind, as {kind: [rank 0's, rank 1's, ...]}."""
    return {kind: [results[i] for results in ranks] for i, kind in enumerate(kinds)}


# Workers (processes of their own, each rank's) are slow on a small machine: one world.
MOVES = [(kind, world) for kind in KINDS for world in (1, 3, 4)
         if kind != "torchdata-workers" or world == 3]


@pytest.fixture(scope="module")
def moved(saves):
    """moved(world): {kind: each rank's (rest of the epoch, next epoch)}, every kind of MOVES
    resumed at ``world`` in one launch, once a world however many tests ask for it."""
    @shared
    def launch(world):
        kinds = [kind for kind, w in MOVES if w == world]
        return per_kind(kinds, run_ranks(world, each, [(resume, saves[kind][0], kind)
                                                        for kind in kinds]))
    return launch


@pytest.mark.parametrize("kind, world", MOVES)
def test_resume_at_another_world_reads_every_row_once(saves, moved, kind, world):
    before = saves[kind][1]
    after = moved(world)[kind]
    rest = [rows for rows, _ in after]
    assert sum(map(len, before)) == 24
    assert counted(before, rest) == {i: 1 for i in range(ROWS)}      # each row once
    assert len({len(rows) for rows in rest}) == 1     # every rank as many batches
    assert [nxt for _, nxt in after] == epoch_rows(world, EPOCH + 1)   # then as ever


@pytest.fixture(scope="module")
def resumed_at_2(saves):
    """{kind: each rank's (rest, next epoch, the epoch read straight)}: every kind resumed
    at its own world, and read without a stop, in one launch."""
    return per_kind(KINDS, run_ranks(2, each, [(resume_and_straight, saves[kind][0], kind)
                                               for kind in KINDS]))


@pytest.mark.parametrize("kind", KINDS)
def test_resume_at_the_same_world_goes_on_as_if_never_stopped(saves, resumed_at_2, kind):
    before, after = saves[kind][1], resumed_at_2[kind]
    assert [b + rows for b, (rows, _, _) in zip(before, after)] == [w for _, _, w in after]
    assert [nxt for _, nxt, _ in after] == epoch_rows(2, EPOCH + 1)


TWO_KINDS = ["torchdata", "torch"]


@pytest.fixture(scope="module")
def again_elsewhere(saves, tmp_path_factory):
    """{kind: (rows read at 3, rows read at 4)}: saves' world-2 checkpoints resumed at 3,
    two batches read and saved again, then resumed at 4 (a launch a world, both kinds)."""
    top = tmp_path_factory.mktemp("again")
    second = {kind: str(top / kind) for kind in TWO_KINDS}
    middle = run_ranks(3, each, [(resume, saves[kind][0], kind, 2, second[kind])
                                 for kind in TWO_KINDS])
    last = run_ranks(4, each, [(resume, second[kind], kind) for kind in TWO_KINDS])
    middle, last = per_kind(TWO_KINDS, middle), per_kind(TWO_KINDS, last)
    return {kind: ([rows for rows, _ in middle[kind]], [rows for rows, _ in last[kind]])
            for kind in TWO_KINDS}


@pytest.mark.parametrize("kind", TWO_KINDS)
def test_a_resumed_epoch_resumes_again_elsewhere(kind, saves, again_elsewhere):
    """2 -> 3 (two batches read, saved) -> 4: still every row once."""
    middle, last = again_elsewhere[kind]
    assert sum(map(len, middle)) == 24
    assert counted(saves[kind][1], middle, last) == {i: 1 for i in range(ROWS)}


@pytest.fixture(scope="module")
def uneven(tmp_path_factory):
    """{kind: (rows read at 2, rows read at 3)}: 5 batches read at world 2 and saved, the
    rest read at 3 (a launch a world, both kinds)."""
    top = tmp_path_factory.mktemp("uneven")
    root = {kind: str(top / kind) for kind in TWO_KINDS}
    before = run_ranks(2, each, [(save_part, root[kind], kind, 5) for kind in TWO_KINDS])
    rest = run_ranks(3, each, [(resume, root[kind], kind) for kind in TWO_KINDS])
    before, rest = per_kind(TWO_KINDS, before), per_kind(TWO_KINDS, rest)
    return {kind: (before[kind], [rows for rows, _ in rest[kind]]) for kind in TWO_KINDS}


@pytest.mark.parametrize("kind", TWO_KINDS)
def test_an_uneven_rest_is_padded_as_the_sampler_pads(kind, uneven):
    """40 rows read at world 2, 200 left for 3 ranks: one row of the epoch's start is read
    again, as DistributedSampler pads an epoch that does not divide."""
    before, rest = uneven[kind]
    first = epoch_rows(1, EPOCH)[0][0]
    assert counted(before, rest) == {i: 2 if i == first else 1 for i in range(ROWS)}
    assert [len(rows) for rows in rest] == [67, 67, 67]


def test_a_loader_of_another_kind_takes_up_the_place(tmp_path):
    """Saved from a StatefulDataLoader, resumed by a ResumableLoader, and the other way, at
    worlds 2 and 3 (each world's saves in one launch, its loads in another)."""
    cases = [(saver, loader, world) for saver, loader in (("torchdata", "torch"),
                                                          ("torch", "torchdata"))
             for world in (2, 3)]
    root = {case: str(tmp_path / "-".join(map(str, case))) for case in cases}
    before = run_ranks(2, each, [(save_part, root[c], c[0], 3) for c in cases])
    for world in (2, 3):
        mine = [i for i, case in enumerate(cases) if case[2] == world]
        after = run_ranks(world, each, [(resume, root[cases[i]], cases[i][1]) for i in mine])
        for i, rests in zip(mine, zip(*after)):
            rest = [rows for rows, _ in rests]
            once = {row: 1 for row in range(ROWS)}
            assert counted([b[i] for b in before], rest) == once, cases[i]


def save_at_epoch_end(rank, world, root, kind, inside):
    """Read all of epoch EPOCH and save: ``inside`` the loop, after its last batch (all
    rows read, the pass not ended), or after it, with the next epoch to come."""
    model, opt = tiny()
    loader, sampler = make_loader(kind)
    sampler.set_epoch(EPOCH)
    batches = len(loader)
    for i, _ in enumerate(loader):
        if inside and i == batches - 1:
            save_checkpoint(root, model, opt, step=1, loader=loader, epoch=EPOCH)
    if not inside:
        save_checkpoint(root, model, opt, step=1, loader=loader, epoch=EPOCH + 1)


def test_an_epoch_read_to_its_end_resumes_at_the_next(tmp_path):
    """Each kind, saved inside and after the loop at world 2 (one launch), resumed at 3 (one)."""
    cases = [(kind, inside) for kind in ("torchdata", "torch") for inside in (True, False)]
    root = {case: str(tmp_path / f"{case[0]}-{case[1]}") for case in cases}
    run_ranks(2, each, [(save_at_epoch_end, root[c], *c) for c in cases])
    after = run_ranks(3, each, [(resume, root[c], c[0]) for c in cases])
    for (kind, inside), resumed in zip(cases, zip(*after)):
        # inside: the saved epoch's pass reads nothing more; then the next, as ever
        assert [rest for rest, _ in resumed] == ([[]] * 3 if inside else
                                                 epoch_rows(3, EPOCH + 1)), (kind, inside)


# -- refusals: on every rank, before anything is loaded ---------------------------------
class KeepsState(Rows):
    """A dataset with a state of its own (as a tokenizing stream might keep)."""

    def state_dict(self):
        return {"seen": 0}

    def load_state_dict(self, state):
        pass


class EveryOther(DistributedSampler):
    """A DistributedSampler subclass that deals its rows otherwise."""

    def __iter__(self):
        return iter(list(super().__iter__())[::-1])


class WrappedState(StatefulDataLoader):
    """A loader that keeps its state under its own key."""

    def state_dict(self):
        return {"inner": super().state_dict()}

    def load_state_dict(self, state):
        super().load_state_dict(state["inner"])


def build(case: str, rank: int = 0):
    """The loader of each refusal case, at save and (the same unless said) at load."""
    if case == "dataset-state":
        data = KeepsState()
        return StatefulDataLoader(data, batch_size=BATCH,
                                  sampler=StatefulDistributedSampler(data, seed=SEED))
    if case == "unknown-sampler":
        return make_loader("torchdata", sampler_class=EveryOther)[0]
    if case == "out-of-order":
        return make_loader("torchdata-workers", in_order=False)[0]
    if case == "not-a-position":      # no position of its own: one is planted beside it
        return StatefulDataLoader(Rows(), batch_size=BATCH, shuffle=True,
                                  generator=torch.Generator().manual_seed(0))
    if case == "unreadable-state":
        data = Rows()
        return WrappedState(data, batch_size=BATCH,
                            sampler=StatefulDistributedSampler(data, seed=SEED))
    return make_loader("torch" if case.startswith("torch") else "torchdata")[0]


def build_at_load(case: str, rank: int):
    if case == "other-seed":               # one rank alone differs
        return make_loader("torchdata", seed=SEED + rank % 2)[0]
    if case == "torch-other-seed":
        return make_loader("torch", seed=SEED + rank % 2)[0]
    if case == "other-rows":
        return make_loader("torchdata", rows=ROWS + 8)[0]
    if case == "no-distributed-sampler":
        return StatefulDataLoader(Rows(), batch_size=BATCH, shuffle=True)
    if case == "not-a-position":
        return make_loader("torchdata")[0]
    return build(case, rank)


def save_cases(rank, world, root):
    for case in REFUSALS:
        model, opt = tiny()
        loader = build(case, rank)
        read(loader, 3)
        planted = {"loader:position": {"read": 24}} if case == "not-a-position" else {}
        save_checkpoint(f"{root}/{case}", model, opt, step=3, loader=as_extra(case, loader),
                        **planted)


def refused_loads(rank, world, root):
    """{case: what its load raised}, each load leaving the model as it was."""
    said = {}
    for case in REFUSALS:
        model, opt = tiny()
        before = [p.detach().clone() for p in model.parameters()]
        try:
            load_checkpoint(f"{root}/{case}", model, opt,
                            loader=as_extra(case, build_at_load(case, rank)))
        except ValueError as e:
            assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
            said[case] = str(e)
    return said


DEALT = "so the rest of that epoch cannot be dealt over 3 ranks: load it at world 2, or " \
        "leave 'loader' out and start epoch 0 again (sampler.set_epoch(0))"
SAVED = "extra 'loader' was saved part way through epoch 0 at world 2 and is loaded at world 3"
REFUSALS = {
    "dataset-state": f"{SAVED}, but its dataset has a state of its own (state_dict), which "
                     f"zerofn cannot deal over another world, {DEALT}",
    "unknown-sampler": f"{SAVED}, but its sampler is a test_data_resume.EveryOther, whose "
                       f"order zerofn does not know (it knows torch's DistributedSampler and "
                       f"torchdata's StatefulDistributedSampler), {DEALT}",
    "out-of-order": f"{SAVED}, but its workers hand batches over out of order "
                    f"(in_order=False), so the batches it yielded are not the first ones of "
                    f"its share, {DEALT}",
    "unreadable-state": f"{SAVED}, but its StatefulDataLoader's state does not say how many "
                        f"batches it has yielded (zerofn reads the layout of torchdata "
                        f"0.11's), {DEALT}",
    "other-seed": f"{SAVED}, from a StatefulDistributedSampler over 240 rows (seed 3, "
                  f"shuffle=True, drop_last=False); here its sampler has seed 4, so the rest "
                  f"of the saved epoch is not the rest of this one: build the sampler as it "
                  f"was saved, or leave 'loader' out and start epoch 0 again "
                  f"(sampler.set_epoch(0))",
    "torch-other-seed": f"{SAVED}, from a DistributedSampler over 240 rows (seed 3, "
                        f"shuffle=True, drop_last=False); here its sampler has seed 4, so the "
                        f"rest of the saved epoch is not the rest of this one: build the "
                        f"sampler as it was saved, or leave 'loader' out and start epoch 0 "
                        f"again (sampler.set_epoch(0))",
    "other-rows": f"{SAVED}, from a StatefulDistributedSampler over 240 rows (seed 3, "
                  f"shuffle=True, drop_last=False); here its sampler has 248 rows, so the "
                  f"rest of the saved epoch is not the rest of this one: build the sampler as "
                  f"it was saved, or leave 'loader' out and start epoch 0 again "
                  f"(sampler.set_epoch(0))",
    "no-distributed-sampler": f"{SAVED}, where its batches come from no DistributedSampler "
                              f"(from a torchdata.stateful_dataloader.sampler.RandomSampler), "
                              f"so the rest of that epoch cannot be dealt: give it a "
                              f"DistributedSampler as at the save (a "
                              f"StatefulDistributedSampler over 240 rows "
                              f"(seed 3, shuffle=True, drop_last=False)), or leave 'loader' "
                              f"out and start epoch 0 again (sampler.set_epoch(0))",
    "not-a-position": "extra 'loader' holds no data position zerofn wrote: load it into the "
                      "kind of loader that saved it, or leave it out",
}


@pytest.fixture(scope="module")
def refusal_cases(tmp_path_factory):
    """Each case of REFUSALS saved at world 2."""
    root = str(tmp_path_factory.mktemp("refusals"))
    run_ranks(2, save_cases, root)
    return root


def test_what_cannot_be_dealt_is_refused_on_every_rank(refusal_cases):
    said = run_ranks(3, refused_loads, refusal_cases)
    for case, text in REFUSALS.items():
        first = 1 if "other-seed" in case else 0      # there only rank 1's sampler differs
        assert [s.get(case) for s in said] == [
            f"Cannot load checkpoint {refusal_cases}/{case}/step-00000003 (rank {first}): "
            f"{text}"] * 3, case


def same_world_loads(rank, world, root, cases):
    return [load_checkpoint(f"{root}/{case}", model, opt,
                            loader=as_extra(case, build(case, rank)))
            for case in cases for model, opt in [tiny()]]


def test_what_cannot_move_still_resumes_at_its_own_world(refusal_cases):
    cases = ["dataset-state", "unknown-sampler", "unreadable-state"]
    assert run_ranks(2, same_world_loads, refusal_cases, cases) == [[{"step": 3}] * 3] * 2


def per_rank_loader():
    return StatefulDataLoader(Rows(), batch_size=BATCH, shuffle=True)


def per_rank_save(rank, world, root):
    model, opt = tiny()
    loader = per_rank_loader()
    read(loader, 3)
    save_checkpoint(root, model, opt, step=3, loader=PerRank(loader))


def per_rank_load(rank, world, root):
    model, opt = tiny()
    try:
        load_checkpoint(root, model, opt, loader=PerRank(per_rank_loader()))
    except ValueError as e:
        return str(e).split(": ", 1)[1]


def test_a_per_rank_loader_with_no_place_is_refused_at_another_world(tmp_path):
    """Over no DistributedSampler, a loader's per-rank state has no global place: it stays
    at its world (over one, it moves: the workers' kind above is saved per rank)."""
    root = str(tmp_path / "ckpt")
    run_ranks(2, per_rank_save, root)
    assert run_ranks(3, per_rank_load, root) == [
        "per-rank state 'loader' was saved by 2 ranks, not 3: it cannot move to another world "
        "size; load without it"] * 3


def test_resumable_loader_refuses_what_it_cannot_count():
    data = Rows()
    cases = {
        "RandomSampler": DataLoader(data, batch_size=BATCH, shuffle=True),
        "EveryOther": DataLoader(data, batch_size=BATCH, sampler=EveryOther(
            data, num_replicas=2, rank=0)),
        "out of order": DataLoader(data, batch_size=BATCH, num_workers=2, in_order=False,
                                   sampler=DistributedSampler(data, num_replicas=2, rank=0)),
    }
    said = {}
    for name, loader in cases.items():
        with pytest.raises(TypeError) as e:
            ResumableLoader(loader)
        said[name] = str(e.value)
    assert said == {
        "RandomSampler": "ResumableLoader: the loader's batches must come from a "
                         "DistributedSampler, as in DataLoader(data, batch_size=b, "
                         "sampler=DistributedSampler(data, ...)); this one's come from "
                         "RandomSampler (DataLoader with batch_size=4).",
        "EveryOther": "ResumableLoader: its sampler is a test_data_resume.EveryOther, whose "
                      "order zerofn does not know (it knows torch's DistributedSampler and "
                      "torchdata's StatefulDistributedSampler), so its place in the epoch "
                      "cannot be kept.",
        "out of order": "ResumableLoader: its workers hand batches over out of order "
                        "(in_order=False), so the batches it yielded are not the first ones "
                        "of its share, so its place in the epoch cannot be kept.",
    }
