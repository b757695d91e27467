"""Orbax restores: one item, or the named items of a step folder, read by ckptshim or by Orbax.

The Orbax hook reads its caller's arguments into :class:`Request`\\ s (one per item) and asks
this module what to do. An item whose layout today's Orbax reads with the caller's args, and
whose keys match the target one to one, is left to Orbax (``native``); so is an item ckptshim
has no plan for (names or shapes no rule mends, args it does not understand: the hook then runs
Orbax's own call, with ckptshim's reading as a note on what Orbax raises). Anything else --
layers stacked differently, Linen vs NNX names, item ``state`` vs ``default``,
pre-``_METADATA`` layouts, legacy Flax, T5X and PaxML layouts -- is restored by
:mod:`ckptshim.loading.jax`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckptshim.errors import NoPlan, ShimError
from ckptshim.formats import flax_msgpack, orbax_manager, t5x
from ckptshim.formats.detect import detect
from ckptshim.formats.orbax import COMMIT_SUCCESS, FIRST_READS, orbax_readers
from ckptshim.loading import agreement, jax as jax_loading
from ckptshim.storage import Location, snapshot

#: What a process decided for a restore, as it tells the others (see :mod:`~ckptshim.loading.agreement`).
NATIVE, SHIM = "orbax restores it", "ckptshim restores it"


@dataclass(frozen=True)
class Request:
    """What one item's restore args ask for, in the terms ckptshim plans with.

    ``reader`` is the Orbax handler the args select ("standard" also stands for no args, which
    needs the ``_METADATA`` Orbax records handlers in); ``item`` the target tree (``None``: as
    stored); ``partial`` whether the caller accepts a checkpoint with more keys than the target.
    """

    reader: str
    item: Any = None
    restore_args: Any = None
    partial: bool = False


def uncommitted_foreign_step(where: Path | Location | None) -> bool:
    """Whether Orbax's refusal of ``where`` as an unfinished save is one ckptshim carries past: a
    checkpoint in object storage that Orbax did not write and that ckptshim reads, a legacy T5X
    step or a legacy Flax msgpack checkpoint (a ``checkpoint_<step>`` file, or their folder).
    There Orbax wants the ``commit_success.txt`` its own saves write, which those writers never
    do (they finish by renaming, the rule Orbax applies locally, where it lets them through);
    ckptshim checks them by their own rules when it opens them (a T5X step's every file as large
    as its ``checkpoint`` msgpack says; a Flax file read whole), as it does locally."""
    return (isinstance(where, Location) and where.is_remote
            and (t5x.is_legacy_step(where) or flax_msgpack.sniff(where))
            and not (where / COMMIT_SUCCESS).exists())


def prepare_item(path: Path | Location, request: Request, where: str, stack: ExitStack) -> jax_loading.Prepared | None:
    """Open and plan one item (closed when ``stack`` exits); ``None`` if ckptshim cannot read it.
    In a bucket, every question opening it asks is answered from one listing of the item and
    the files an Orbax item is read from first, fetched beside it (:func:`~ckptshim.storage.snapshot.listed`)."""
    with snapshot.listed(path, FIRST_READS):
        checkpoint = jax_loading.open_item(path)
        if checkpoint is None:
            return None
        stack.callback(checkpoint.close)
        return jax_loading.prepare(checkpoint, request.item, where, request.restore_args)


def fits(prepared: jax_loading.Prepared, request: Request) -> bool:
    """Whether Orbax itself restores this: a layout it reads, keys matching the target's."""
    readable = request.reader in orbax_readers(prepared.checkpoint)
    return jax_loading.native_fits(prepared, readable=readable, partial=request.partial)


def restore_item(path: Path | Location, request: Request | None, where: str, native: Callable[[], Any]) -> Any:
    """One item at ``path``: restored by ckptshim, or by ``native()`` where Orbax can do it itself
    (or where the request is not one ckptshim understands: ``None``)."""
    with ExitStack() as stack:
        with agreement.agreeing(where, "planning") as planned:
            prepared = None if request is None else prepare_item(path, request, where, stack)
            planned.decision = NATIVE if prepared is None or fits(prepared, request) else SHIM
        if planned.decision == NATIVE:
            return native()
        return prepared.run()


def restore_items(step_dir: Path | Location, requested: Mapping[str, Request | None], where: str,
                  native: Callable[[list[str]], Mapping[str, Any]],
                  *, force: bool = False) -> dict[str, Any] | None:
    """Restore the named items of ``step_dir``, or ``None`` when Orbax can do it all itself.

    ``requested`` maps item names to their requests (``None``: args ckptshim leaves to Orbax).
    Train-state names the step lacks are matched to its one train-state item nobody else asked
    for (``state`` vs ``default`` vs ``items``: :func:`match_items`). Items that are not array
    trees (JSON metadata, ...) and requests ckptshim does not understand are restored by
    ``native(names)``, first. ``force``: restore the array items here even where Orbax could
    (used after Orbax failed to). A step in object storage that the client cannot reach is
    Orbax's (``None``), as for one item (:func:`~ckptshim.loading.jax.open_item`).
    """
    with ExitStack() as stack:
        with snapshot.listed(step_dir):  # one listing of the step answers for its items too
            if isinstance(step_dir, Location) and not jax_loading.reachable(step_dir):
                return None
            with agreement.agreeing(where, "planning") as planned:
                folders = match_items(step_dir, requested)
                prepared: dict[str, jax_loading.Prepared] = {}
                shim = force or any(folder.name != name for name, folder in folders.items())
                for name, folder in folders.items():
                    request = requested[name]
                    item = None if request is None else prepare_item(folder, request, f"{where} item {name!r}", stack)
                    if item is not None:
                        prepared[name] = item
                        shim = shim or not fits(item, request)
                planned.decision = SHIM if shim else NATIVE
        if planned.decision == NATIVE:
            return None
        rest = [name for name in requested if name not in prepared]  # Orbax's first: JSON items fail fast
        results = dict(native(rest)) if rest else {}
        results.update((name, item.run()) for name, item in prepared.items())
    return {name: results[name] for name in requested}


#: Item names that each mean "the train state" in a layout ckptshim knows: a single-item
#: manager's ``default``, ``state`` (T5X, MaxText before 2024), ``items`` (MaxText today).
STATE_ITEMS = frozenset({"default", "state", "items"})


def match_items(step_dir: Path | Location, requested: Iterable[str]) -> dict[str, Path | Location]:
    """Requested item name -> array item folder on disk (only for names that have one).

    A train-state name the step lacks (:data:`STATE_ITEMS`) stands for the one train-state item
    of the step that no other name asks for. Any other name the step lacks, or a train-state
    name no one item stands for, leaves ckptshim without a plan (:class:`~ckptshim.errors.NoPlan`):
    that is the caller's item to name, and Orbax's to refuse.
    """
    on_disk = array_items(step_dir)
    spare = [name for name in on_disk if name not in requested and name in STATE_ITEMS]
    out: dict[str, Path | Location] = {}
    for name in requested:
        if name in on_disk:
            out[name] = on_disk[name]
        elif (step_dir / name).exists():
            continue  # an item Orbax keeps in its own format (JSON metadata, ...)
        elif name in STATE_ITEMS and len(spare) == 1:
            out[name] = on_disk[spare.pop()]
        else:
            could = f" and {len(spare)} of them could be it" if name in STATE_ITEMS and spare else ""
            raise NoPlan(
                f"the restore asks for item {name!r}, but checkpoint step {step_dir} holds "
                f"{', '.join(repr(n) for n in on_disk) or 'no array items'}{could}. Name the item "
                f"the checkpoint uses (e.g. args=ocp.args.Composite({next(iter(on_disk), 'state')}=...)).")
    return out


def array_items(step_dir: Path | Location) -> dict[str, Path | Location]:
    """Item name -> folder, for the items of a step folder that hold arrays ckptshim reads: Orbax
    PyTree items, and folders in a format a JAX restore takes (a Hugging Face folder standing in
    for MaxText's ``items``). In object storage: the Orbax items ckptshim reads there."""
    if isinstance(step_dir, Location):
        return dict(orbax_manager.remote_items(step_dir))
    found: dict[str, Path | Location] = dict(orbax_manager.items(step_dir))
    if step_dir.is_dir():
        found.update((child.name, child) for child in sorted(step_dir.iterdir())
                     if child.name not in found and child.is_dir() and _foreign_array_item(child))
    return found


def _foreign_array_item(path: Path) -> bool:
    """Whether the item folder ``path`` holds arrays in a format a JAX restore takes that is not
    an Orbax item. Anything ckptshim cannot recognise -- or refuses to look into -- stays
    Orbax's to restore, as without ckptshim."""
    try:
        detect(path, "jax")
    except ShimError:
        return False
    return True


def items_on_disk(step_dir: Path | Location) -> list[str]:
    """The array items a step folder holds (what a restore without args reads)."""
    return list(array_items(step_dir))


#: The most entries ckptshim lists in a step folder: a step holds a handful of items.
STEP_ENTRIES = 10_000


def item_folders(step_dir: Path | Location) -> list[str]:
    """The names of the folders in a step (each an item, or Orbax's own reserved ones), sorted."""
    return [info.location.name for info in Location.of(step_dir).list(STEP_ENTRIES) if info.kind == "directory"]


#: The item a single-item ``CheckpointManager`` saves (Orbax's ``DEFAULT_ITEM_NAME``).
DEFAULT_ITEM = "default"


@dataclass(frozen=True)
class ItemRename:
    """One item that a manager restore's args and its step name differently: ``asked`` in the
    args (``default`` for single-item args), ``stored`` in the step."""

    asked: str
    stored: str

    def explain(self) -> str:
        if self.stored == DEFAULT_ITEM:
            return f"the step holds one unnamed item ({DEFAULT_ITEM!r}), restored as item {self.asked!r}"
        return f"the step holds item {self.stored!r}, restored for the single-item args"


def manager_rename(step_dir: Path | Location, single: bool, asked: list[str]) -> ItemRename | None:
    """How a ``CheckpointManager`` that has not settled on single or composite items restores
    ``step_dir`` with single-item (``single``) or composite args naming ``asked``.

    Orbax decides from the step (a ``default`` folder means one unnamed item) and refuses args
    of the other kind. ``None`` where Orbax's manager takes the args as they are; else the rename
    that makes them the step's kind, between train-state names (:data:`STATE_ITEMS`): single-item
    args read the step's one train-state item, and composite args that name one train-state item
    read a single-item step's. Otherwise ckptshim has no plan (:class:`~ckptshim.errors.NoPlan`),
    and Orbax's refusal stands.
    """
    if single == (step_dir / DEFAULT_ITEM).exists():
        return None
    if not single:
        if len(asked) != 1 or asked[0] not in STATE_ITEMS:
            raise NoPlan(f"checkpoint step {step_dir} holds one unnamed item ({DEFAULT_ITEM!r}), and the "
                         f"restore names {', '.join(map(repr, asked))}, which ckptshim does not take for it "
                         f"(it stands in for one of {', '.join(map(repr, sorted(STATE_ITEMS)))})")
        return ItemRename(asked[0], DEFAULT_ITEM)
    return ItemRename(DEFAULT_ITEM, match_items(step_dir, [DEFAULT_ITEM])[DEFAULT_ITEM].name)
