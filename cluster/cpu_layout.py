"""Cores of their own for CPU engines, and the rest of the node for everything else.

On vLLM's CPU backend an engine's step is its OpenMP threads computing; with one
thread per engine, that is the engine core's main thread. Everything else on the
node (Ray's daemons, Serve's controller and proxy, the ingress and engine
replicas, the router, the page store) wakes many times a second, and left to the
scheduler it lands on the engine's core and preempts the engine mid-step.

``engine.cpu_cores: reserved`` lays the node out before its Ray processes start:
each engine gets a slot of ``omp_num_threads`` cores of its own (the node's last
ones), and the process that starts the cluster moves itself onto the other
cores, which every Ray process it starts inherits. The slots travel to the
engine replicas in ``MOE_CLUSTER_ENGINE_CORES``; each replica claims a free one
(an abstract Unix socket bound under the slot's name: the kernel frees it when
the process ends, so a restarted replica finds its predecessor's slot free) and
spawns its engine onto it. With the one-thread, in-process engine (``executor:
uni``), only the engine core's main thread stays there; its other threads
(vLLM's socket I/O, gloo, the page store's committer) join the serving cores.

``engine.cpu_cores: pinned`` keeps each engine on its slot the same way, but
leaves every core of the node to the rest of the cluster: the engine no longer
moves between cores, leaving its warm caches behind, while a flood's serving
work may still use its core when the others are busy. The default, ``auto``,
reserves where the engines leave a core for the rest, pins where they have a
core each and none is left, and shares the cores otherwise. What each costs and
gains, measured with one replica on 2 cores, is in the README.

Only a cluster that ``moe-cluster serve`` starts is laid out: the layout names
the cores of the one node it starts on. Engine replicas of a cluster joined
another way see no ``MOE_CLUSTER_ENGINE_CORES`` and share the cores.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass

import psutil

from cluster.config import ClusterConfig
from cluster.platform import Backend

logger = logging.getLogger("moe_cluster.cpu_layout")

ENV = "MOE_CLUSTER_ENGINE_CORES"


@dataclass(frozen=True)
class Layout:
    """``slots``: each engine's cores; ``serving``: the rest of the cluster's,
    every other core of the node (``reserved``) or every core (``pinned``).
    ``name`` is unique per cluster start: it names the slots' claims, so two
    clusters on one machine never share them."""

    name: str
    slots: tuple[tuple[int, ...], ...]
    serving: tuple[int, ...]

    def to_env(self) -> str:
        return json.dumps(
            {"name": self.name, "slots": self.slots, "serving": self.serving}
        )

    @classmethod
    def from_env(cls, value: str) -> Layout:
        d = json.loads(value)
        return cls(
            str(d["name"]),
            tuple(tuple(int(c) for c in s) for s in d["slots"]),
            tuple(int(c) for c in d["serving"]),
        )

    @property
    def exclusive(self) -> bool:
        """Whether the slots' cores are the engines' alone (``reserved``)."""
        return not set(self.serving).intersection(set().union(*self.slots))

    def describe(self) -> str:
        slots = ", ".join(_cores(s) for s in self.slots)
        if not self.exclusive:
            return (
                f"engines pinned to cores {slots} (one slot each), the rest of the "
                f"cluster on every core ({_cores(self.serving)})"
            )
        return (
            f"engines on cores {slots} (one slot each), the rest of the cluster on "
            f"{_cores(self.serving)}"
        )


def _cores(cores: Sequence[int]) -> str:
    return ",".join(str(c) for c in cores)


def plan(
    cores: Sequence[int], engines: int, threads: int, name: str, exclusive: bool = True
) -> Layout:
    """``engines`` slots of ``threads`` cores each, from the end of ``cores``;
    ``exclusive``: the rest of the cluster gets the other cores, and at least one
    must be left (ValueError otherwise); else it gets every core."""
    ordered = sorted(cores)
    need = engines * threads
    spare = 1 if exclusive else 0  # a core left for the rest of the cluster
    if need + spare > len(ordered):
        more = " and one more for the rest of the cluster" if exclusive else ""
        raise ValueError(
            f"{engines} engine{'s' * (engines > 1)} of {threads} "
            f"thread{'s' * (threads > 1)} need {need} cores of their own{more}; "
            f"this node lets it use {len(ordered)} ({_cores(ordered)})"
        )
    engine_cores = ordered[len(ordered) - need :]
    slots = tuple(
        tuple(engine_cores[i * threads : (i + 1) * threads]) for i in range(engines)
    )
    serving = ordered[: len(ordered) - need] if exclusive else ordered
    return Layout(name, slots, tuple(serving))


def engines_on_node(config: ClusterConfig) -> int:
    """The most engines a cluster of ``config`` on one node runs at once, each
    started by a replica of its own: replicas (or EP groups, up to the
    autoscaler's most) times EP ranks."""
    d = config.deployment
    replicas = d.num_replicas
    if d.autoscaling.enabled:
        replicas = max(replicas, d.autoscaling.max_replicas)
    ranks = config.expert_parallel.ranks if config.expert_parallel.enabled else 1
    return replicas * ranks


def cores_per_engine(config: ClusterConfig) -> int:
    """One engine's compute threads: its OpenMP threads in each tensor-parallel
    rank (the ranks' worker processes share their engine's slot)."""
    assert config.engine.omp_num_threads is not None
    return config.engine.omp_num_threads * config.engine.tensor_parallel_size


def for_local_cluster(
    config: ClusterConfig, cores: Sequence[int] | None = None
) -> tuple[Layout | None, str]:
    """The layout of a new one-node cluster of ``config`` (``cores``: the node's
    cores this process may use), or None and why its engines share the cores
    (``auto`` reserves where it can, else pins, else shares them). Raises
    ValueError, saying why, where ``engine.cpu_cores`` (``pinned`` or
    ``reserved``) cannot be."""
    e = config.engine
    if e.cpu_cores == "shared":
        return None, "engine.cpu_cores is shared"
    why = _cannot_lay_out(config)
    if not why:
        available = sorted(cores if cores is not None else os.sched_getaffinity(0))
        name = f"{os.getpid()}-{time.time_ns()}"
        threads, engines = cores_per_engine(config), engines_on_node(config)
        # auto: reserved where a core is left for the rest, else pinned.
        tries = {"auto": (True, False), "reserved": (True,), "pinned": (False,)}
        for exclusive in tries[e.cpu_cores]:
            try:
                return plan(available, engines, threads, name, exclusive), ""
            except ValueError as err:
                why = str(err)
    if e.cpu_cores == "auto":
        return None, why
    raise ValueError(f"engine.cpu_cores: {e.cpu_cores}, but {why}")


def _cannot_lay_out(config: ClusterConfig) -> str:
    """Why no engine of ``config`` can have cores of its own, or ''."""
    e = config.engine
    if config.engine_platform().backend is Backend.GPU:
        return "the engines run on GPUs"
    if e.omp_num_threads is None:
        return (
            "engine.omp_num_threads is not set (how many cores an engine computes on)"
        )
    if e.cpu_omp_threads_bind != "nobind":
        return f"engine.cpu_omp_threads_bind is {e.cpu_omp_threads_bind!r}"
    return ""


def apply(layout: Layout) -> None:
    """Moves the calling thread onto the serving cores (so every process it starts
    from now, Ray's included, runs there) and hands the layout to them."""
    os.sched_setaffinity(0, layout.serving)
    os.environ[ENV] = layout.to_env()


def current() -> Layout | None:
    """The layout this process was started under, if any."""
    value = os.environ.get(ENV)
    return Layout.from_env(value) if value else None


class Claim:
    """One engine slot, held by this process until it ends or ``release``."""

    def __init__(self, layout: Layout, slot: int, sock: socket.socket) -> None:
        self.layout, self.slot, self._sock = layout, slot, sock

    @property
    def cores(self) -> tuple[int, ...]:
        return self.layout.slots[self.slot]

    @classmethod
    def take(cls, layout: Layout) -> Claim | None:
        """The first free slot of ``layout``, or None when every one is held."""
        for i in range(len(layout.slots)):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.bind(f"\0moe-cluster-engine-cores/{layout.name}/{i}")
            except OSError:
                sock.close()
                continue
            return cls(layout, i, sock)
        return None

    def release(self) -> None:
        self._sock.close()


@contextmanager
def spawning(
    layout: Layout, claim: Claim | None, one_thread_in_process: bool
) -> Iterator[None]:
    """Processes the calling thread starts inside run on the claimed slot's cores;
    without a claim (every slot taken: more engines than the layout counted, as
    when an external autoscaler adds one), on every core of the node, as if it
    were not laid out, rather than crowding the serving cores. Processes started
    inside that are not vLLM's join the serving cores. ``one_thread_in_process``:
    the engine computes on its engine core's main thread alone (one OpenMP
    thread, uni executor), so with a claim every other thread of it serves too."""
    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    serving = set(layout.serving)
    node = serving.union(*layout.slots)
    os.sched_setaffinity(0, claim.cores if claim is not None else node)
    try:
        yield
    finally:
        os.sched_setaffinity(0, serving)
        # Threads this one started inside inherited its cores: back to serving.
        _move_threads(os.getpid(), serving, keep=set())
        for child in me.children(recursive=True):
            if child.pid in before:
                continue
            title = _title(child)
            if not title.startswith("VLLM::"):
                _move_threads(child.pid, serving, keep=set())
            elif (
                claim is not None
                and one_thread_in_process
                and title.startswith("VLLM::EngineCore")
            ):
                _move_threads(child.pid, serving, keep={child.pid})
                logger.info(
                    "engine core %d computes on core %s (slot %d); its other "
                    "threads and the rest of the cluster on %s",
                    child.pid,
                    _cores(claim.cores),
                    claim.slot,
                    _cores(layout.serving),
                )


def _title(p: psutil.Process) -> str:
    try:
        cmd = p.cmdline()
    except psutil.Error:
        return ""
    return str(cmd[0]) if cmd else ""


def _move_threads(pid: int, cores: set[int], keep: set[int]) -> None:
    """Every thread of ``pid`` but those in ``keep`` onto ``cores`` (threads that
    end meanwhile are skipped)."""
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return
    for tid in tids:
        if tid in keep:
            continue
        with suppress(OSError):
            os.sched_setaffinity(tid, cores)
