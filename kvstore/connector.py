"""vLLM KV connector onto the node's page store (vLLM itself stays unmodified).

Loaded by vLLM from ``kv_transfer_config``::

    KVTransferConfig(kv_connector="PageStoreConnector",
                     kv_connector_module_path="kvstore.connector",
                     kv_role="kv_both", kv_load_failure_policy="recompute",
                     kv_connector_extra_config={"socket": <node store socket>,
                                                "staging_bytes": <GPU staging>})

A page is one KV block of every layer (``kvstore.page_layer``), named by vLLM's own
chained block hash (the tenant's ``cache_salt`` is in the first block's hash, so
tenants never share pages). As vLLM's own connectors are, this one is two halves
behind vLLM's interface: ``StoreScheduler`` in the engine core
(``kvstore.connector_scheduler``: which pages a request loads, which blocks a step
saves) and ``StoreWorker`` in the model runner (``kvstore.connector_worker``: the
checked copies between the arena and the paged cache). ``StoreMetadata`` carries
one step's plan from the first to the second.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from cluster import tracing
from kvstore.connector_scheduler import Loads, PageSave, StoreScheduler
from kvstore.connector_worker import StoreWorker
from kvstore.page_layer import DeviceCopier
from kvstore.rpc import StoreClient

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = logging.getLogger("moe_cluster.kvstore")


def transfer_config(socket: str, staging_bytes: int = DeviceCopier.CHUNK_BYTES) -> Any:
    """vLLM's ``kv_transfer_config`` for an engine using the node store at
    ``socket``; on a GPU its pages go through staging buffers of
    ``staging_bytes`` (``DeviceCopier``)."""
    from vllm.config import KVTransferConfig

    return KVTransferConfig(
        kv_connector=PageStoreConnector.__name__,
        kv_connector_module_path=__name__,
        kv_role="kv_both",
        # A page that fails its checksum is recomputed, never served.
        kv_load_failure_policy="recompute",
        kv_connector_extra_config={"socket": socket, "staging_bytes": staging_bytes},
    )


@dataclass
class StoreMetadata(KVConnectorMetadata):
    loads: dict[str, Loads] = field(default_factory=dict)  # request id -> its pages
    saves: list[PageSave] = field(default_factory=list)  # blocks this step completes


class PageStoreConnector(KVConnectorBase_V1):
    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)  # type: ignore[arg-type]
        if vllm_config.parallel_config.tensor_parallel_size > 1:
            raise ValueError(
                "the page store connector serves engines with tensor_parallel_size 1 "
                "(data-parallel ranks each have their own)"
            )
        # vLLM's engine-core or worker process: Ray's logging is not set up here.
        tracing.install_process_logging()
        extra = self._kv_transfer_config.kv_connector_extra_config
        self._client = StoreClient(str(extra["socket"]))
        staging = extra.get("staging_bytes", DeviceCopier.CHUNK_BYTES)
        if type(staging) is not int or staging <= 0:
            raise ValueError(
                f"kv_connector_extra_config.staging_bytes must be a positive "
                f"integer, not {staging!r}"
            )
        block_size = vllm_config.cache_config.block_size
        self._warned = False
        self.scheduler: StoreScheduler | None = None
        self.worker: StoreWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler = StoreScheduler(
                self._client,
                block_size,
                self._warn,
                engine_caches=bool(vllm_config.cache_config.enable_prefix_caching),
                max_running=vllm_config.scheduler_config.max_num_seqs,
                engine_blocks=kv_cache_config.num_blocks if kv_cache_config else 0,
            )
        else:
            self.worker = StoreWorker(
                self._client,
                kv_cache_config.num_blocks if kv_cache_config else 0,
                str(vllm_config.model_config.served_model_name),
                block_size,
                self._warn,
                staging,
            )

    # ==== scheduler side =====================================================

    def on_new_request(self, request: Request) -> None:
        assert self.scheduler is not None
        self.scheduler.on_new_request(request)  # type: ignore[arg-type]

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self.scheduler is not None
        matched = self.scheduler.get_num_new_matched_tokens(
            request,  # type: ignore[arg-type]
            num_computed_tokens,
        )
        return matched, False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        assert self.scheduler is not None
        self.scheduler.update_state_after_alloc(
            request,  # type: ignore[arg-type]
            blocks.get_block_ids()[0],
            num_external_tokens,
        )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> StoreMetadata:
        assert self.scheduler is not None
        manager = self._kv_cache_manager
        loads, saves = self.scheduler.plan_step(
            scheduler_output.num_scheduled_tokens,
            None if manager is None else (lambda rid: manager.get_block_ids(rid)[0]),
        )
        return StoreMetadata(loads, saves)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self.scheduler is not None
        self.scheduler.request_finished(request)  # type: ignore[arg-type]
        return False, None  # saves are copied in the step that completes them

    # ==== worker side ========================================================

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self.worker is not None
        self.worker.register(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        # Called by the model runner before every forward pass, on every path.
        super().bind_connector_metadata(connector_metadata)
        if self.worker is not None and isinstance(connector_metadata, StoreMetadata):
            self.worker.before_forward(connector_metadata.saves)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, StoreMetadata) and self.worker is not None
        self.worker.start_load(meta.loads)

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
        assert isinstance(meta, StoreMetadata) and self.worker is not None
        self.worker.save(meta.saves)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.load_errors() if self.worker is not None else set()

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
        if self.scheduler is not None:
            self.scheduler.close()
        self._client.close()

    def _warn(self, error: Exception) -> None:
        # A store that is gone costs cache hits, never requests.
        if not self._warned:
            logger.warning("page store unavailable (%s); continuing without it", error)
            self._warned = True
