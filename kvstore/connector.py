"""vLLM KV connector onto the node's page store (vLLM itself stays unmodified).

Loaded by vLLM from ``kv_transfer_config``::

    KVTransferConfig(kv_connector="PageStoreConnector",
                     kv_connector_module_path="kvstore.connector",
                     kv_role="kv_both", kv_load_failure_policy="recompute",
                     kv_connector_extra_config={"socket": <node store socket>})

A page is one KV block of every layer, ``[layer 0 block | layer 1 block | ...]`` in
the engine's own cache layout, named by vLLM's own chained block hash (the tenant's
``cache_salt`` is in the first block's hash, so tenants never share pages).

Scheduler side (engine-core process):
    ``get_num_new_matched_tokens`` asks the store for the longest stored run of the
    prompt's full blocks past those the engine's own prefix cache holds (always
    leaving one prompt token to compute) and pins those pages under the request's
    id: a caching engine is offered, and the store counts, only what it adds. When
    another node holds more of the prefix, the store starts fetching it and the
    request waits a step or two (``None``) instead of recomputing.
    ``build_connector_meta`` lists, per step, the pages to load into the blocks
    just allocated and the blocks that this step completes, to save.

Worker side (model-runner process), with the arena mapped:
    ``start_load_kv`` checks each page's checksum in place and copies it into the
    request's blocks before the forward pass; a page that fails is dropped from the
    store and its blocks (and every later one of the request) are reported to vLLM,
    which recomputes them. ``wait_for_save`` copies the blocks completed this step
    into reserved pages; a background thread checksums and publishes them, so the
    step waits only for the copy. On CUDA the arena is registered as pinned memory
    and both copies run on a side stream.
"""

from __future__ import annotations

import logging
import queue
import threading
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvstore.arena import Arena, Bytes, checksum
from kvstore.rpc import StoreClient, StoreError

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = logging.getLogger("moe_cluster.kvstore")


def transfer_config(socket: str) -> Any:
    """vLLM's ``kv_transfer_config`` for an engine using the node store at
    ``socket``."""
    from vllm.config import KVTransferConfig

    return KVTransferConfig(
        kv_connector=PageStoreConnector.__name__,
        kv_connector_module_path=__name__,
        kv_role="kv_both",
        # A page that fails its checksum is recomputed, never served.
        kv_load_failure_policy="recompute",
        kv_connector_extra_config={"socket": socket},
    )


@dataclass
class StoreMetadata(KVConnectorMetadata):
    # request id -> (arena the slots are in, [(slot, checksum, page hash, block id)])
    # to copy in before the step
    loads: dict[str, tuple[str, list[tuple[int, int, bytes, int]]]] = field(
        default_factory=dict
    )
    # [(page hash, block id)] of blocks this step completes
    saves: list[tuple[bytes, int]] = field(default_factory=list)


class PageLayer:
    """One layer's part of every page (``nbytes`` at ``offset``) and that
    layer's paged cache, between which loads and saves copy."""

    def __init__(
        self, name: str, cache: torch.Tensor, block_dim: int, offset: int
    ) -> None:
        self.name, self.cache = name, cache
        self.block_dim, self.offset = block_dim, offset  # dim indexing blocks
        self.shape = tuple(cache.select(block_dim, 0).shape)
        self.nbytes = cache.select(block_dim, 0).numel() * cache.element_size()
        # On CPU, numpy copies of these small blocks cost a fraction of torch's
        # per-call overhead (2-8x the bandwidth here); on CUDA the copy is a DMA
        # from pinned memory, issued by torch.
        self._host = None if cache.is_cuda else cache.view(torch.uint8).numpy()

    def block(self, block_id: int) -> torch.Tensor:
        return self.cache.select(self.block_dim, block_id)

    def _host_block(self, block_id: int) -> npt.NDArray[np.uint8]:
        assert self._host is not None
        view: npt.NDArray[np.uint8] = self._host[
            (slice(None),) * self.block_dim + (block_id,)
        ]
        return view

    def load(self, page: Bytes, block_id: int, non_blocking: bool = False) -> None:
        """Copies this layer's part of ``page`` (an arena row) into the block."""
        part = page[self.offset : self.offset + self.nbytes]
        if self._host is not None:
            dst = self._host_block(block_id)
            np.copyto(dst, part.reshape(dst.shape))
        else:
            blk = self.block(block_id)
            src = torch.from_numpy(part).view(blk.dtype).view(blk.shape)
            blk.copy_(src, non_blocking=non_blocking)

    def save(self, page: Bytes, block_id: int, non_blocking: bool = False) -> None:
        """Copies the block into this layer's part of ``page``."""
        part = page[self.offset : self.offset + self.nbytes]
        if self._host is not None:
            src = self._host_block(block_id)
            np.copyto(part.reshape(src.shape), src)
        else:
            blk = self.block(block_id)
            dst = torch.from_numpy(part).view(blk.dtype).view(blk.shape)
            dst.copy_(blk, non_blocking=non_blocking)


class PageStoreConnector(KVConnectorBase_V1):
    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)  # type: ignore[arg-type]
        extra = self._kv_transfer_config.kv_connector_extra_config
        self._client = StoreClient(str(extra["socket"]))
        self._block_size = vllm_config.cache_config.block_size
        self._num_blocks = kv_cache_config.num_blocks if kv_cache_config else 0
        if vllm_config.parallel_config.tensor_parallel_size > 1:
            raise ValueError(
                "the page store connector serves engines with tensor_parallel_size 1 "
                "(data-parallel ranks each have their own)"
            )
        # scheduler side
        self._requests: dict[str, Request] = {}
        self._found: dict[str, tuple[int, list[Any], str]] = {}  # (skip, refs, arena)
        self._to_load: dict[str, tuple[str, list[tuple[int, int, bytes, int]]]] = {}
        self._saved: dict[str, int] = {}  # full blocks already handed to the store
        # worker side
        self._layers: list[PageLayer] = []
        self._arena: Arena | None = None
        self._registered: torch.Tensor | None = None  # the arena, page-locked (CUDA)
        self._page_bytes, self._layout = 0, ""
        # Arenas of a store that restarted: still mapped until shutdown, as a
        # commit in flight may read them.
        self._retired: list[Arena] = []
        self._load_errors: set[int] = set()
        self._stream: Any = None
        # (arena, slots written, CUDA event marking the copies done) to checksum
        # and publish
        self._commits: queue.Queue[tuple[Arena, list[int], Any] | None] = queue.Queue()
        self._committer: threading.Thread | None = None
        self._warned = False

    # ==== scheduler side =====================================================

    def on_new_request(self, request: Request) -> None:
        self._requests[request.request_id] = request

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        rid, b = request.request_id, self._block_size
        full = (request.num_prompt_tokens - 1) // b  # one prompt token is computed
        hashes = request.block_hashes[:full]
        skip = num_computed_tokens // b
        found = self._found.get(rid)
        if found is not None and found[0] == skip:
            # Asked again while the request waits for room: its pages are still
            # pinned for it.
            return len(found[1]) * b, False
        self._drop_found(rid)
        if not hashes:
            return 0, False
        # Asked even when the engine holds every block: the store counts the
        # reuse towards the hot prefixes new replicas warm up with.
        try:
            refs, pending, arena = self._client.call(
                "lookup",
                rid,
                hashes,
                request.cache_salt or "",
                (request.prompt_token_ids or [])[: full * b],
                b,
                skip,
            )
        except StoreError as e:
            self._warn(e)
            return 0, False
        if pending:
            return None, False  # another node's pages are on their way
        if not refs:
            return 0, False
        self._found[rid] = (skip, refs, arena)
        return len(refs) * b, False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        rid = request.request_id
        found = self._found.pop(rid, None)
        if found is None:
            return
        if num_external_tokens == 0:
            self._release(rid)
            return
        skip, refs, arena = found
        # refs[i] is the prompt's block skip + i (the engine holds the first skip).
        block_ids = blocks.get_block_ids()[0]
        self._to_load[rid] = (
            arena,
            [
                (slot, crc, h, block_ids[skip + i])
                for i, (slot, h, crc) in enumerate(refs)
            ],
        )
        self._saved[rid] = max(self._saved.get(rid, 0), skip + len(refs))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> StoreMetadata:
        meta = StoreMetadata(loads=self._to_load)
        self._to_load = {}
        manager, b = self._kv_cache_manager, self._block_size
        for rid, n in scheduler_output.num_scheduled_tokens.items():
            req = self._requests.get(rid)
            if req is None or manager is None:
                continue
            # Blocks whose every token is in the cache once this step has run.
            done = min(len(req.block_hashes), (req.num_computed_tokens + n) // b)
            # A block that failed to load is recomputed (num_computed_tokens moved
            # back), and saved again.
            start = min(self._saved.get(rid, 0), req.num_computed_tokens // b)
            if done <= start:
                continue
            block_ids = manager.get_block_ids(rid)[0]
            meta.saves += [
                (req.block_hashes[i], block_ids[i]) for i in range(start, done)
            ]
            self._saved[rid] = done
        return meta

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        self._drop_found(rid)
        if self._to_load.pop(rid, None) is not None:
            self._release(rid)
        self._requests.pop(rid, None)
        self._saved.pop(rid, None)
        return False, None  # saves are copied in the step that completes them

    def _drop_found(self, rid: str) -> None:
        if self._found.pop(rid, None) is not None:
            self._release(rid)

    def _release(self, rid: str) -> None:
        try:
            self._client.call("release", rid)
        except StoreError as e:
            self._warn(e)

    # ==== worker side ========================================================

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        offset = 0
        for name, cache in kv_caches.items():
            dims = [d for d, size in enumerate(cache.shape) if size == self._num_blocks]
            if not dims or dims[0] > 1:
                raise ValueError(
                    f"KV cache {name} of shape {tuple(cache.shape)} has no block "
                    f"dimension of {self._num_blocks} blocks in front"
                )
            layer = PageLayer(name, cache, dims[0], offset)
            self._layers.append(layer)
            offset += layer.nbytes
        first = next(iter(kv_caches.values()))
        self._page_bytes = offset
        self._layout = (
            f"{self._vllm_config.model_config.served_model_name}|{first.dtype}|"
            f"block {self._block_size}|" + ",".join(f"{x.shape}" for x in self._layers)
        )
        if first.is_cuda:
            self._stream = torch.cuda.Stream(device=first.device)  # type: ignore[no-untyped-call]
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
            name, num_pages, page_bytes = self._client.call(
                "open", self._page_bytes, self._layout
            )
        except StoreError as e:
            if at_start:
                raise
            self._warn(e)
            return ""
        name = str(name)
        if self._arena is not None:
            if self._arena.name == name:
                return name
            logger.warning("page store restarted: mapping its new arena %s", name)
            self._unregister_arena()
            self._retired.append(self._arena)
        self._arena = Arena.attach(name, num_pages, page_bytes)
        if self._stream is not None:
            # Page-locked arena: host<->device copies run asynchronously by DMA.
            pages = torch.from_numpy(self._arena.pages())
            cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
            cudart.cudaHostRegister(pages.data_ptr(), pages.numel(), 0)
            self._registered = pages
        logger.info(
            "page store: %d pages of %d bytes (%d layers) in %s",
            num_pages,
            page_bytes,
            len(self._layers),
            name,
        )
        return name

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

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, StoreMetadata)
        if self._stream is not None:
            # Saves of the last step read blocks this step may overwrite.
            torch.cuda.current_stream().wait_stream(self._stream)
        if not meta.loads:
            return
        bad: list[bytes] = []
        for arena_name, pages in meta.loads.values():
            if not self._arena_is(arena_name):
                # The store restarted between lookup and load: recompute.
                self._load_errors.update(p[3] for p in pages)
                continue
            assert self._arena is not None
            for i, (slot, crc, h, block_id) in enumerate(pages):
                page = self._arena.page(slot)
                if checksum(page) != crc:
                    # Never serve it: this block and the rest of the prefix are
                    # recomputed by vLLM.
                    bad.append(h)
                    self._load_errors.update(p[3] for p in pages[i:])
                    break
                for layer in self._layers:
                    layer.load(page, block_id, non_blocking=self._stream is not None)
        if self._stream is not None:
            torch.cuda.current_stream().synchronize()  # loaded before the forward
        try:
            if bad:
                logger.warning("page store: %d corrupt pages dropped", len(bad))
                self._client.call("drop", bad)
            self._client.call("release", *meta.loads)
        except StoreError as e:
            self._warn(e)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads complete in start_load_kv

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        return  # whole pages are saved once every layer has run (wait_for_save)

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, StoreMetadata)
        if not meta.saves or not self._layers:
            return
        try:
            slots, arena_name = self._client.call("reserve", [h for h, _ in meta.saves])
            if not self._arena_is(arena_name):
                self._client.call("abandon", [x for x in slots if x is not None])
                return
        except StoreError as e:
            # A store that restarted has no arena until an engine opens it.
            self._warn(e)
            self._attach()
            return
        assert self._arena is not None
        written = []
        stream = self._stream
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream) if stream is not None else nullcontext():
            for slot, (_, block_id) in zip(slots, meta.saves, strict=True):
                if slot is None:
                    continue  # stored already (or the store is full of pinned pages)
                page = self._arena.page(slot)
                for layer in self._layers:
                    layer.save(page, block_id, non_blocking=stream is not None)
                written.append(slot)
        if written:
            event = None
            if stream is not None:
                event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                event.record(stream)
            self._commits.put((self._arena, written, event))

    def _commit_loop(self) -> None:
        """Checksums saved pages and publishes them, off the engine's step."""
        while (item := self._commits.get()) is not None:
            arena, slots, event = item
            if event is not None:
                event.synchronize()
            done = [(s, checksum(arena.page(s))) for s in slots]
            try:
                self._client.call("commit", done)
            except StoreError as e:
                self._warn(e)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        if self._committer is not None:
            self._commits.put(None)
            self._committer.join(timeout=5)
        self._client.close()
        self._unregister_arena()
        self._layers = []
        for arena in [*self._retired, *([self._arena] if self._arena else [])]:
            arena.close()
        self._arena, self._retired = None, []

    def _warn(self, error: Exception) -> None:
        # A store that is gone costs cache hits, never requests.
        if not self._warned:
            logger.warning("page store unavailable (%s); continuing without it", error)
            self._warned = True
