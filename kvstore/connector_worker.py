"""The connector's worker side (vLLM's model-runner process), with the arena mapped.

``start_load`` copies each page into the request's blocks before the forward
pass, checking its checksum on the way; a page that fails is dropped from the
store and its blocks (and every later one of the request) are reported to vLLM,
which recomputes them. ``save`` copies the blocks completed this step into
reserved pages, summing them on the way; a background thread publishes them, so
the step waits only for the copy. The slots are asked for before the forward
pass (``before_forward``) and the answer read after it, so the store answers
while the step computes, on another core where the engine has one of its own.

Host caches are copied a page at a time (``page_layer.PageCopier``). For caches
in GPU memory the arena is page-locked and a request's pages go through a
staging buffer on the device, one DMA copy each (``page_layer.DeviceCopier``):
loads on the engine's stream, waited for before the leases on the pages end;
saves on a side stream that first waits for the engine's, and that the engine's
stream then waits for: the next step's work (zeroing the blocks it allocates
anew, among them blocks freed by requests that just finished) comes after
the copies.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from cluster import tracing
from kvstore.arena import Arena, checksum
from kvstore.connector_scheduler import Loads, PageSave
from kvstore.page_layer import DeviceCopier, PageCopier, PageLayer, Saved
from kvstore.rpc import (
    ConnectionLost,
    Pending,
    Reserved,
    StoreClient,
    StoreError,
    Written,
)

logger = logging.getLogger("moe_cluster.kvstore")


def _load_span(rid: str, request: Loads, began: int | None = None) -> Any:
    """The request's load span, from ``began`` (ns; None: now) to its exit."""
    return tracing.tracer().start_as_current_span(
        "kvstore.load",
        context=tracing.context_of(request.trace),
        attributes={"moe_cluster.kv.pages_planned": len(request.pages)},
        start_time=began,
    )


def _log_unloaded(request: Loads, loaded: tuple[int, int]) -> None:
    """A warning, in the request's log context, when some of its pages did not
    load (a checksum failure, or the store restarted): vLLM recomputes them."""
    if (missed := len(request.pages) - loaded[0]) > 0:
        logger.warning(
            "%d of %d stored pages not loaded (checksum failure or store restart): "
            "recomputed",
            missed,
            len(request.pages),
        )


def _loaded(span: Any, request: Loads, loaded: tuple[int, int]) -> None:
    A = tracing.Attr
    pages, nbytes = loaded
    failed = len(request.pages) - pages
    span.set_attributes(
        {
            A.KV_PAGES_LOADED: pages,
            A.KV_BYTES_LOADED: nbytes,
            A.KV_CHECKSUM_FAILURES: 1 if failed else 0,
        }
    )
    if failed:
        span.add_event("checksum.failed", {"moe_cluster.kv.pages_recomputed": failed})


class StoreWorker:
    def __init__(
        self,
        client: StoreClient,
        num_blocks: int,
        model: str,
        block_size: int,
        warn: Callable[[Exception], None],
        staging_bytes: int = DeviceCopier.CHUNK_BYTES,
    ) -> None:
        self._client, self._num_blocks, self._warn = client, num_blocks, warn
        self._staging_bytes = staging_bytes  # each of DeviceCopier's buffers
        self._model, self._block_size = model, block_size  # named in the layout
        self._layers: list[PageLayer] = []
        self._copier: PageCopier | None = None
        self._device: DeviceCopier | None = None  # caches in GPU memory
        self._arena: Arena | None = None
        self._registered: torch.Tensor | None = None  # the arena, page-locked (CUDA)
        self._page_bytes, self._layout = 0, ""
        # Arenas of a store that restarted: still mapped until shutdown, as a
        # commit in flight may read them.
        self._retired: list[Arena] = []
        self._load_errors: set[int] = set()
        self._stream: Any = None
        # (arena, slots written with their checksums where the copy took them,
        # CUDA event marking the copies done, their sums taken on the GPU) to
        # checksum and publish
        self._commits: queue.Queue[
            tuple[Arena, list[tuple[int, int | None]], Any, Saved | None] | None
        ] = queue.Queue()
        self._committer: threading.Thread | None = None
        # This step's saves and their ``reserve``, sent before the forward pass.
        self._reserving: tuple[Sequence[PageSave], Pending] | None = None

    @property
    def layers(self) -> list[PageLayer]:
        return self._layers

    def register(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        offset = 0
        for name, cache in kv_caches.items():
            layer = PageLayer.of_vllm_cache(name, cache, self._num_blocks, offset)
            self._layers.append(layer)
            offset += layer.nbytes
        first = next(iter(kv_caches.values()))
        self._page_bytes = offset
        # Engines share a store only with pages of the same layout.
        self._layout = (
            f"{self._model}|{first.dtype}|block {self._block_size}|"
            + ",".join(f"{x.shape}" for x in self._layers)
        )
        if first.is_cuda:
            self._stream = torch.cuda.Stream(device=first.device)  # type: ignore[no-untyped-call]
            if offset > self._staging_bytes:
                raise ValueError(
                    f"a page of this engine's cache ({offset} bytes) does not fit "
                    f"a staging buffer of {self._staging_bytes} bytes: raise "
                    "kvstore.gpu_staging_mib"
                )
            self._device = DeviceCopier(
                self._layers,
                offset,
                chunk_bytes=self._staging_bytes,
                max_pages=self._num_blocks,
            )
            logger.info(
                "page copies through %.0f MiB of staging on %s",
                self._device.device_bytes / 2**20,
                first.device,
            )
        else:
            self._copier = PageCopier(self._layers, offset)
        self._attach(at_start=True)
        self._committer = threading.Thread(
            target=self._commit_loop, name="kvstore-commit", daemon=True
        )
        self._committer.start()

    def _attach(self, at_start: bool = False) -> str:
        """Maps the store's current arena: at start, and when the store restarted
        (its answers then name another arena). Returns the arena's name, or ""
        when the store cannot be reached (at start, that is an error: so is an
        engine whose pages differ from those of the store)."""
        try:
            info = self._client.open(self._page_bytes, self._layout)
        except StoreError as e:
            if at_start:
                raise
            self._warn(e)
            return ""
        if self._arena is not None:
            if self._arena.name == info.name:
                return info.name
            logger.warning("page store restarted: mapping its new arena %s", info.name)
            self._unregister_arena()
            self._retired.append(self._arena)
        self._arena = Arena.attach(info.name, info.num_pages, info.page_bytes)
        if self._stream is not None:
            # Page-locked arena: host<->device copies run asynchronously by DMA.
            pages = torch.from_numpy(self._arena.pages())
            cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
            error = int(cudart.cudaHostRegister(pages.data_ptr(), pages.numel(), 0))
            if error:
                # Copies from pageable memory are still right, but each waits for
                # the host (staged by the driver) instead of running by DMA.
                logger.warning(
                    "could not page-lock the arena %s (cudaHostRegister error %d): "
                    "page copies run unpinned",
                    info.name,
                    error,
                )
            else:
                self._registered = pages
        logger.info(
            "page store: %d pages of %d bytes (%d layers) in %s",
            info.num_pages,
            info.page_bytes,
            len(self._layers),
            info.name,
        )
        return info.name

    def _unregister_arena(self) -> None:
        if self._registered is not None:
            torch.cuda.cudart().cudaHostUnregister(  # type: ignore[no-untyped-call]
                self._registered.data_ptr()
            )
        self._registered = None

    def _arena_is(self, name: str) -> bool:
        """Whether ``name`` is (after re-attaching if needed) the mapped arena."""
        if self._arena is not None and self._arena.name == name:
            return True
        return bool(name) and self._attach() == name

    def before_forward(self, saves: Sequence[PageSave]) -> None:
        """Asks for the slots of the blocks this step completes, before its
        forward pass; ``save`` reads the answer after it."""
        self._settle_reserving()
        if not saves or not self._layers:
            return
        try:
            pending = self._client.send_reserve([s.page_hash for s in saves])
        except StoreError:
            return  # save asks again, and warns if it fails again
        self._reserving = (saves, pending)

    def _settle_reserving(self) -> None:
        """Gives back the slots of a ``reserve`` sent for a step that saved
        nothing (it failed before ``save``)."""
        if (reserving := self._reserving) is None:
            return
        self._reserving = None
        try:
            slots = self._client.reserved(reserving[1]).slots
            if taken := [x for x in slots if x is not None]:
                self._client.abandon(taken)
        except StoreError as e:
            self._warn(e)

    def _reserve(self, saves: Sequence[PageSave]) -> Reserved:
        """The slots for ``saves``: the answer to the ``reserve`` sent before
        the forward pass, or (none sent, or its connection failed) a new one."""
        if (reserving := self._reserving) is not None and reserving[0] is saves:
            self._reserving = None
            try:
                return self._client.reserved(reserving[1])
            except ConnectionLost:
                pass  # it broke while the forward ran: ask on a new one
        self._settle_reserving()  # sent for other saves, if any: given back
        return self._client.reserve([s.page_hash for s in saves])

    def start_load(self, loads: Mapping[str, Loads]) -> None:
        if not loads:
            return
        bad: list[bytes] = []
        for rid, request, loaded, began in self._load_all(loads, bad):
            token = tracing.REQUEST_ID.set(rid)  # its log lines carry its ids
            try:
                if request.trace:
                    with _load_span(rid, request, began) as span:
                        _loaded(span, request, loaded)
                        _log_unloaded(request, loaded)
                else:
                    _log_unloaded(request, loaded)
            finally:
                tracing.REQUEST_ID.reset(token)
        try:
            if bad:
                self._client.drop(bad)
            self._client.release(*loads)
        except StoreError as e:
            self._warn(e)

    def _load_all(
        self, loads: Mapping[str, Loads], bad: list[bytes]
    ) -> Iterator[tuple[str, Loads, tuple[int, int], int]]:
        """Loads each request's pages, up to the first that fails its checksum
        (added to ``bad``). Yields each request with (pages loaded, bytes loaded)
        and when its copy began (ns): on the host one request after another, on
        a GPU every request of the step in one copy, waited for once (the
        leases on the pages end when the step's loads return)."""
        for request in loads.values():
            self._arena_is(request.arena)  # re-attached if the store restarted
        arena = self._arena
        ready = {
            rid: r
            for rid, r in loads.items()
            if arena is not None and r.arena == arena.name
        }
        for rid, request in loads.items():
            if rid not in ready:  # the store restarted after its lookup: recompute
                self._load_errors.update(p.block_id for p in request.pages)
                yield rid, request, (0, 0), time.time_ns()
        if not ready:
            return
        assert arena is not None
        if self._device is not None:
            began = time.time_ns()
            pages = [p for r in ready.values() for p in r.pages]
            good = self._device.load(
                [arena.page(p.slot) for p in pages],
                [p.block_id for p in pages],
                [p.checksum for p in pages],
            )
            at = 0
            for rid, request in ready.items():
                ok = good[at : at + len(request.pages)]
                at += len(request.pages)
                loaded = next((i for i, x in enumerate(ok) if not x), len(ok))
                yield rid, request, self._settle(arena, request, loaded, bad), began
            return
        assert self._copier is not None
        for rid, request in ready.items():
            began, loaded = time.time_ns(), 0
            for p in request.pages:
                if not self._copier.load(arena.page(p.slot), p.block_id, p.checksum):
                    break
                loaded += 1
            yield rid, request, self._settle(arena, request, loaded, bad), began

    def _settle(
        self, arena: Arena, request: Loads, loaded: int, bad: list[bytes]
    ) -> tuple[int, int]:
        """(pages loaded, bytes loaded) of a request whose first ``loaded``
        pages loaded; the page after them, if any, failed its checksum."""
        pages = request.pages
        if loaded < len(pages):
            # Never serve it: this block and the rest of the prefix are
            # recomputed by vLLM.
            bad.append(pages[loaded].page_hash)
            self._load_errors.update(q.block_id for q in pages[loaded:])
        return loaded, loaded * arena.page_bytes

    def save(self, saves: Sequence[PageSave]) -> None:
        if not saves or not self._layers:
            return
        try:
            reserved = self._reserve(saves)
            if not self._arena_is(reserved.arena):
                self._client.abandon([x for x in reserved.slots if x is not None])
                return
        except StoreError as e:
            # A store that restarted has no arena until an engine opens it.
            self._warn(e)
            self._attach()
            return
        assert self._arena is not None
        arena, stream = self._arena, self._stream
        todo = [  # no slot: stored already (or the store is full of pinned pages)
            (slot, s.block_id)
            for slot, s in zip(reserved.slots, saves, strict=True)
            if slot is not None
        ]
        if not todo:
            return
        if self._device is None:
            assert self._copier is not None
            written = [
                (slot, self._copier.save(arena.page(slot), block))
                for slot, block in todo
            ]
            self._commits.put((arena, written, None, None))
            return
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            sums = self._device.save(
                [arena.page(slot) for slot, _ in todo], [block for _, block in todo]
            )
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(stream)
        # The next step may zero or overwrite a block being saved (one freed by
        # a request that just finished): its work waits for the copies.
        torch.cuda.current_stream().wait_stream(stream)
        self._commits.put((arena, [(slot, None) for slot, _ in todo], event, sums))

    def _commit_loop(self) -> None:
        """Publishes saved pages, off the engine's step, checksumming those that
        were not summed as they were copied."""
        while (item := self._commits.get()) is not None:
            arena, slots, event, sums = item
            if event is not None:
                event.synchronize()
            if sums is not None and self._device is not None:
                crcs = self._device.checksums(sums)
                slots = [(s, crc) for (s, _), crc in zip(slots, crcs, strict=True)]
            done = [
                Written(s, checksum(arena.page(s)) if c is None else c)
                for s, c in slots
            ]
            try:
                self._client.commit(done, arena.name)
            except StoreError as e:
                self._warn(e)

    def load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        if self._committer is not None:
            self._commits.put(None)
            self._committer.join(timeout=5)
        self._unregister_arena()
        self._layers, self._copier, self._device = [], None, None
        for arena in [*self._retired, *([self._arena] if self._arena else [])]:
            arena.close()
        self._arena, self._retired = None, []
