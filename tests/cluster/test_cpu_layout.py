"""engine.cpu_cores: how a node's cores are laid out, and the slot claims and
spawning that put an engine onto its cores (real processes, real affinities)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psutil
import pytest

from cluster import cpu_layout
from cluster.config import ClusterConfig
from cluster.cpu_layout import Claim, Layout, plan


def config(**engine: Any) -> ClusterConfig:
    deployment = engine.pop("deployment", {})
    return ClusterConfig.model_validate(
        {
            "model": {"path": "/m", "served_name": "m"},
            "engine": {"attention_backend": "CPU_MLA", "omp_num_threads": 1} | engine,
            "deployment": {"num_replicas": 1} | deployment,
        }
    )


def test_engines_take_the_last_cores_and_leave_the_rest() -> None:
    assert plan([0, 1], 1, 1, "n") == Layout("n", ((1,),), (0,))
    assert plan(range(8), 2, 3, "n") == Layout("n", ((2, 3, 4), (5, 6, 7)), (0, 1))
    assert plan([5, 3, 9], 1, 2, "n").slots == ((5, 9),)  # sorted, not positional
    with pytest.raises(ValueError, match="need 2 cores of their own and one more"):
        plan([0, 1], 2, 1, "n")


def test_pinned_engines_take_the_last_cores_and_leave_every_core_to_the_rest() -> None:
    pinned = plan([0, 1], 1, 1, "n", exclusive=False)
    assert pinned == Layout("n", ((1,),), (0, 1))
    assert not pinned.exclusive and plan([0, 1], 1, 1, "n").exclusive
    assert pinned.describe() == (
        "engines pinned to cores 1 (one slot each), the rest of the cluster on "
        "every core (0,1)"
    )
    both = plan([0, 1], 2, 1, "n", exclusive=False)  # a core each, none left over
    assert both.slots == ((0,), (1,)) and both.serving == (0, 1)
    assert not both.exclusive and both.describe().startswith("engines pinned")
    with pytest.raises(ValueError, match="need 3 cores of their own; this node"):
        plan([0, 1], 3, 1, "n", exclusive=False)
    assert Layout.from_env(both.to_env()) == both


def test_layout_travels_in_the_environment() -> None:
    layout = plan(range(8), 2, 3, "123-456")
    assert Layout.from_env(layout.to_env()) == layout
    assert layout.describe() == (
        "engines on cores 2,3,4, 5,6,7 (one slot each), the rest of the cluster on 0,1"
    )


def test_reserved_lays_out_only_with_a_core_left_for_the_rest() -> None:
    assert cpu_layout.for_local_cluster(config(cpu_cores="shared"), [0, 1])[0] is None
    layout = cpu_layout.for_local_cluster(config(cpu_cores="reserved"), [0, 1])[0]
    assert layout is not None and layout.slots == ((1,),)
    assert layout.serving == (0,)
    two = config(cpu_cores="reserved", deployment={"num_replicas": 2})
    with pytest.raises(ValueError, match="reserved, but 2 engines of 1 thread need"):
        cpu_layout.for_local_cluster(two, [0, 1])
    assert cpu_layout.for_local_cluster(two, [0, 1, 2])[0] is not None
    # The autoscaler's most replicas count: they would share the slots otherwise.
    scaled = config(
        cpu_cores="reserved",
        deployment={"autoscaling": {"enabled": True, "max_replicas": 3}},
    )
    with pytest.raises(ValueError, match="3 engines"):
        cpu_layout.for_local_cluster(scaled, [0, 1, 2])
    # Tensor-parallel ranks are one engine's processes: one slot, their cores.
    tp = config(cpu_cores="reserved", omp_num_threads=2, tensor_parallel_size=2)
    layout = cpu_layout.for_local_cluster(tp, range(6))[0]
    assert layout is not None and layout.slots == ((2, 3, 4, 5),)
    with pytest.raises(ValueError, match=r"reserved, but engine\.omp_num_threads"):
        cpu_layout.for_local_cluster(
            config(cpu_cores="reserved", omp_num_threads=None), [0, 1]
        )
    bound = config(cpu_cores="reserved", cpu_omp_threads_bind="0-1")
    with pytest.raises(ValueError, match="cpu_omp_threads_bind"):
        cpu_layout.for_local_cluster(bound, [0, 1])
    with pytest.raises(ValueError, match="cpu_cores"):
        config(cpu_cores="always")


def test_pinned_lays_out_while_the_engines_have_a_core_each() -> None:
    layout = cpu_layout.for_local_cluster(config(cpu_cores="pinned"), [0, 1])[0]
    assert layout is not None and layout.slots == ((1,),)
    assert layout.serving == (0, 1)
    two = config(cpu_cores="pinned", deployment={"num_replicas": 2})
    layout = cpu_layout.for_local_cluster(two, [0, 1])[0]
    assert layout is not None and layout.slots == ((0,), (1,))
    three = config(cpu_cores="pinned", deployment={"num_replicas": 3})
    with pytest.raises(ValueError, match="pinned, but 3 engines of 1 thread need 3"):
        cpu_layout.for_local_cluster(three, [0, 1])
    with pytest.raises(ValueError, match=r"pinned, but engine\.omp_num_threads"):
        cpu_layout.for_local_cluster(
            config(cpu_cores="pinned", omp_num_threads=None), [0, 1]
        )


def test_auto_reserves_else_pins_else_shares() -> None:
    assert config().engine.cpu_cores == "auto"  # the default
    layout, why = cpu_layout.for_local_cluster(config(), [0, 1])
    assert layout is not None and (layout.slots, layout.serving) == (((1,),), (0,))
    assert layout.exclusive and why == ""
    # Two engines on 2 cores: a core each, none left for the rest: pinned.
    two = config(deployment={"num_replicas": 2})
    layout, why = cpu_layout.for_local_cluster(two, [0, 1])
    assert layout is not None and (layout.slots, layout.serving) == (
        ((0,), (1,)),
        (0, 1),
    )
    assert not layout.exclusive and why == ""
    layout, _ = cpu_layout.for_local_cluster(two, [0, 1, 2])
    assert layout is not None and layout.exclusive and layout.serving == (0,)
    three = config(deployment={"num_replicas": 3})
    assert cpu_layout.for_local_cluster(three, [0, 1]) == (
        None,
        "3 engines of 1 thread need 3 cores of their own; this node lets it use "
        "2 (0,1)",
    )
    unset = config(omp_num_threads=None)
    layout, why = cpu_layout.for_local_cluster(unset, [0, 1])
    assert layout is None and why.startswith("engine.omp_num_threads is not set")
    gpu = config(attention_backend="auto", deployment={"num_gpus": 1})
    assert cpu_layout.for_local_cluster(gpu, [0, 1]) == (
        None,
        "the engines run on GPUs",
    )
    assert cpu_layout.for_local_cluster(config(cpu_cores="shared"), [0, 1]) == (
        None,
        "engine.cpu_cores is shared",
    )


def test_each_slot_is_claimed_once_and_freed_with_its_holder() -> None:
    layout = plan(range(4), 2, 1, f"test-{os.getpid()}-claims")
    first, second = Claim.take(layout), Claim.take(layout)
    assert first is not None and second is not None
    assert (first.slot, second.slot) == (0, 1)
    assert (first.cores, second.cores) == ((2,), (3,))
    assert Claim.take(layout) is None  # both held
    first.release()
    again = Claim.take(layout)
    assert again is not None and again.slot == 0
    again.release()
    second.release()
    # A process that holds a slot and ends (a replica that died) frees it.
    holder = subprocess.run(
        [
            sys.executable,
            "-c",
            "from cluster.cpu_layout import Claim, Layout; import sys; "
            "c = Claim.take(Layout.from_env(sys.argv[1])); print(c.slot)",
            layout.to_env(),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert holder.stdout.strip() == "0"
    freed = Claim.take(layout)
    assert freed is not None and freed.slot == 0
    freed.release()


@pytest.fixture(params=["reserved", "pinned"])
def two_cores(request: pytest.FixtureRequest) -> Iterator[Layout]:
    """A layout of this machine's last core for one engine, the rest serving on
    the other cores (reserved) or on every core (pinned); this thread's
    affinity as it was afterwards."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("a layout needs 2 cores")
    before = os.sched_getaffinity(0)
    mode = request.param
    try:
        yield plan(
            cores, 1, 1, f"test-{os.getpid()}-{mode}", exclusive=mode == "reserved"
        )
    finally:
        os.sched_setaffinity(0, before)


CHILD = """
import os, sys, threading, time
if sys.argv[1] == "engine":
    import setproctitle
    setproctitle.setproctitle("VLLM::EngineCore")
threading.Thread(target=time.sleep, args=(30,), daemon=True).start()
print("ready", flush=True)
time.sleep(30)
"""


def _affinities(pid: int) -> dict[int, set[int]]:
    return {
        int(t): os.sched_getaffinity(int(t)) for t in os.listdir(f"/proc/{pid}/task")
    }


@pytest.mark.parametrize("one_thread", [True, False])
def test_an_engine_spawned_in_its_slot_computes_there(
    two_cores: Layout, one_thread: bool
) -> None:
    claim = Claim.take(two_cores)
    assert claim is not None
    slot, serving = set(claim.cores), set(two_cores.serving)
    try:
        with spawn(two_cores, claim, one_thread) as (engine, helper):
            threads = _affinities(engine.pid)
            assert threads.pop(engine.pid) == slot  # the engine core's main thread
            assert len(threads) >= 1
            # A process started beside the engine that is not one serves.
            assert all(a == serving for a in _affinities(helper.pid).values())
            if one_thread:
                # The engine core computes on its main thread; its others serve.
                assert all(a == serving for a in threads.values()), threads
            else:
                # Several OpenMP threads: the whole engine stays on its slot.
                assert all(a == slot for a in threads.values()), threads
    finally:
        claim.release()


def test_an_engine_past_the_slots_runs_anywhere(two_cores: Layout) -> None:
    """Not crowded onto the serving cores with everything else."""
    node, serving = set(os.sched_getaffinity(0)), set(two_cores.serving)
    with spawn(two_cores, None, True) as (engine, helper):
        assert all(a == node for a in _affinities(engine.pid).values())
        assert all(a == serving for a in _affinities(helper.pid).values())


@contextmanager
def spawn(
    layout: Layout, claim: Claim | None, one_thread: bool
) -> Iterator[tuple[subprocess.Popen[str], subprocess.Popen[str]]]:
    """An engine core (by its title) and a helper process, started inside
    ``cpu_layout.spawning``; the spawning thread is on the serving cores after."""
    children: list[subprocess.Popen[str]] = []
    try:
        with cpu_layout.spawning(layout, claim, one_thread):
            for kind in ("engine", "helper"):
                p = subprocess.Popen(
                    [sys.executable, "-c", CHILD, kind],
                    stdout=subprocess.PIPE,
                    text=True,
                )
                children.append(p)
                assert p.stdout is not None and p.stdout.readline() == "ready\n"
        assert os.sched_getaffinity(0) == set(layout.serving)
        assert psutil.Process(children[0].pid).cmdline()[0] == "VLLM::EngineCore"
        yield children[0], children[1]
    finally:
        for p in children:
            p.kill()
            p.wait()
