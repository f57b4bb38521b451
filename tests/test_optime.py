"""Op timing alone (planner/probe/optime.py): which arguments a call finds cold in the step, the cache's
keys (call, cold arguments, timing method, device and torch version), and the cold-timing path. Each
test uses a temporary cache directory and calls small enough to time in milliseconds."""

import pytest
import torch

from memplan.planner.core.opclass import op_class
from memplan.planner.probe.optime import (
    OpTimer,
    cold_arguments,
    device_identity,
    last_level_cache_bytes,
    materialise,
    record_call,
    reuse_distances,
    storage_number,
)

CPU = torch.device("cpu")


def _call(func, *args):
    """An OpCall of ``func(*args)`` recorded from real tensors (the fake trace records fake ones)."""
    return record_call(func, args, {}, func(*args))


def _timer(tmp_path, **kw):
    return OpTimer(CPU, cache_dir=tmp_path, min_runs=1, target_s=0.0, **kw)


def test_arguments_are_cold_when_new_to_the_step_or_evicted_by_the_bytes_moved_since():
    a = torch.rand(10)  # 40 bytes
    b = torch.relu(a)
    big = torch.rand(1000)  # 4,000 bytes: more than the cache below
    calls = [_call(torch.ops.aten.relu.default, a),    # a: never touched in this step
             _call(torch.ops.aten.neg.default, b),     # b: written by the call before (80 bytes ago)
             _call(torch.ops.aten.neg.default, big),   # moves 8,000 bytes
             _call(torch.ops.aten.neg.default, b)]     # b: 8,000 bytes ago
    # the first relu wrote a fresh storage, not b's: record b as that call's output for the model
    calls[0].output_storage_ids = (storage_number(b.untyped_storage()),)
    assert cold_arguments(calls, cache_bytes=1000) == [{0}, set(), {0}, {0}]
    assert cold_arguments(calls, cache_bytes=10**6) == [{0}, set(), {0}, set()]
    # the distances themselves, from one walk (the timer reads them against the LLC and the core's cache):
    # b was written 0 bytes ago (the call before wrote it last), then 8,040 ago (its neg's output, big read
    # and written)
    distances = reuse_distances(calls)
    assert distances == [(None,), (0,), (None,), (8000 + 40,)]
    assert cold_arguments(calls, 1000, distances) == cold_arguments(calls, 1000)


def test_reuse_distance_counts_distinct_storages_not_traffic():
    """A weight read by every step of an unrolled cell fills the cache once: between two reads of ``x``
    five in-place updates of ``w`` move 10 x 400 bytes but touch 400 distinct bytes (the LRU stack
    distance), so ``x`` stays hot in a 1,000-byte cache; a larger tensor in between evicts it."""
    x, w, big = torch.rand(10), torch.rand(100), torch.rand(300)
    touch_x = _call(torch.ops.aten.neg_.default, x)
    updates = [_call(torch.ops.aten.neg_.default, w) for _ in range(5)]
    assert cold_arguments([touch_x, *updates, touch_x], cache_bytes=1000)[-1] == set()
    evict = _call(torch.ops.aten.neg_.default, big)  # 1,200 distinct bytes
    assert cold_arguments([touch_x, *updates, evict, touch_x], cache_bytes=1000)[-1] == {0}


def test_an_argument_read_twice_in_one_call_is_one_storage():
    x = torch.rand(8, 8)
    call = _call(torch.ops.aten.mm.default, x, x.t())
    assert len(call.storage_ids) == 1 and cold_arguments([call], 10**6) == [{0}]


def test_the_cache_key_names_the_call_its_cold_arguments_the_method_and_the_device(tmp_path):
    call = _call(torch.ops.aten.add.Tensor, torch.rand(4), torch.rand(4))
    cold, warm = _timer(tmp_path), _timer(tmp_path, cold=False)
    keys = {cold.cache_key(call, frozenset()), cold.cache_key(call, frozenset({0})),
            cold.cache_key(call, frozenset({0, 1})), warm.cache_key(call)}
    assert len(keys) == 4
    assert warm.cache_key(call, frozenset({0})) == warm.cache_key(call)  # a warm timer has no cold arguments
    assert torch.__version__ in cold.identity and device_identity(CPU) in cold.identity
    assert "timing=cold" in cold.identity and "timing=warm" in warm.identity
    other = _call(torch.ops.aten.add.Tensor, torch.rand(5), torch.rand(5))
    assert cold.cache_key(other) != cold.cache_key(call)


def test_times_are_cached_by_call_and_coldness(tmp_path):
    x, y = torch.rand(64), torch.rand(64)
    # the second add reads what the first wrote: hot; the first one's arguments are new to the step
    first = _call(torch.ops.aten.add.Tensor, x, y)
    z = torch.rand(64)
    second = _call(torch.ops.aten.add.Tensor, z, z)
    second.storage_ids = (first.output_storage_ids[0],)
    timer = _timer(tmp_path)
    timings = timer.time([first, second])
    assert timer.stats.distinct == 2 and timer.stats.isolated_runs == 2
    assert all(t.source == "isolated" and t.time_s > 0 for t in timings)
    again = _timer(tmp_path)
    assert [t.time_s for t in again.time([first, second])] == [t.time_s for t in timings]
    assert again.stats.cache_hits == 2 and again.stats.isolated_runs == 0
    alone = _timer(tmp_path)
    alone.time([second])  # alone, its argument is new to the step: cold, another key
    assert alone.stats.cache_hits == 0 and alone.stats.isolated_runs == 1
    warm = _timer(tmp_path, cold=False)
    warm.time([first])
    assert warm.stats.cache_hits == 0 and warm.stats.isolated_runs == 1


def test_cold_runs_flush_the_cache_and_hot_ones_do_not(tmp_path, monkeypatch):
    x = torch.rand(256)
    first = _call(torch.ops.aten.relu.default, x)      # x new to the step: cold
    second = _call(torch.ops.aten.neg.default, x)      # x just read: hot
    flushes = []
    timer = OpTimer(CPU, cache_dir=tmp_path, min_runs=3, target_s=0.0, sweeps=2)
    monkeypatch.setattr(timer, "flush_caches", lambda: flushes.append(1))
    timer.time([first])
    assert len(flushes) == 6  # one per timed run, in each of the two sweeps
    flushes.clear()
    timer.time([first, second])  # the relu is cached now; the neg finds x hot
    assert timer.stats.cache_hits == 1 and not flushes


def test_a_call_beyond_its_cores_cache_is_timed_in_the_steps_context_on_a_cpu(tmp_path, monkeypatch):
    """On a CPU a step's call finds the shared cache holding other calls' data: a call with an argument
    whose reuse distance is over the core's own cache (here 1 KiB) is timed after a flush, each run, with
    the spare run's output held; one whose arguments the calls just before touched within that cache is
    timed back to back, as before. The two are cached apart, and the identity names the method."""
    x = torch.rand(64)                                  # 256 B
    big = torch.rand(1024)                              # 4 KiB: more than the core's cache below
    first = _call(torch.ops.aten.relu.default, x)       # x new to the step: cold (and beyond the core)
    second = _call(torch.ops.aten.neg.default, x)       # x just read: in the core's cache
    evict = _call(torch.ops.aten.relu.default, big)     # 8 KiB through the core's cache
    third = _call(torch.ops.aten.neg.default, x)        # x: in the shared cache, beyond the core's
    flushes = []
    timer = OpTimer(CPU, cache_dir=tmp_path, min_runs=3, target_s=0.0, sweeps=1)
    monkeypatch.setattr(timer, "_core", 1024)
    monkeypatch.setattr(timer, "flush_caches", lambda: flushes.append(1))
    assert "context=flushed,held>1024" in timer.identity
    timer.time([second])  # alone: x is new to the step
    assert len(flushes) == 3
    flushes.clear()
    timer.time([first, second])
    assert timer.stats.isolated_runs == 3 and len(flushes) == 3  # relu in context; the neg hot, back to back
    flushes.clear()
    timer.time([first, second, evict, third])
    # relu and the hot neg cached; the big relu (new to the step) and the evicted neg: in context
    assert timer.stats.isolated_runs == 5 and len(flushes) == 6
    assert timer.cache_key(second, frozenset(), True) != timer.cache_key(second, frozenset(), False)
    warm = OpTimer(CPU, cache_dir=tmp_path, min_runs=3, target_s=0.0, sweeps=1, cold=False)
    assert "context" not in warm.identity


def test_in_the_steps_context_the_timed_output_does_not_land_in_the_block_just_written(tmp_path, monkeypatch):
    """A step's output lands in memory the cache has not seen lately; run after run alone, a call's output
    lands in the block its previous run freed, hot. In the step's context the spare run's output is held
    while the timed run writes its own: the two never share an address."""
    outputs: list[tuple[str, int]] = []
    timer = OpTimer(CPU, cache_dir=tmp_path, min_runs=3, target_s=0.0, sweeps=1)
    monkeypatch.setattr(timer, "_core", 0)  # every argument beyond the core's cache: every call in context
    monkeypatch.setattr(timer, "flush_caches", lambda: outputs.append(("flush", 0)))
    import dataclasses

    x = torch.rand(4096)
    call = _call(torch.ops.aten.neg.default, x)

    def kernel(a):
        out = torch.neg(a)
        outputs.append(("run", out.data_ptr()))
        return out

    timer.time([dataclasses.replace(call, func=kernel)])
    runs = [i for i, (what, _) in enumerate(outputs) if what == "flush"]
    assert len(runs) == 3
    for i in runs:  # each flush is followed by the spare run, then the timed run
        (_, spare), (_, timed) = outputs[i + 1], outputs[i + 2]
        assert spare != timed


def test_the_flush_buffer_outsizes_the_last_level_cache(tmp_path):
    cache_bytes = last_level_cache_bytes(CPU)
    assert cache_bytes >= 2**16
    timer = _timer(tmp_path)
    assert timer.flush_bytes == 2 * cache_bytes
    timer.flush_caches()  # allocates and writes it


def test_a_burst_of_load_in_one_sweep_does_not_move_a_calls_time(tmp_path, monkeypatch):
    """Each distinct call is timed once per sweep and its time is the median of the sweeps: a figure
    spoiled while the machine was busy (the 100 s below) is outvoted, however many calls share the key."""
    x = torch.rand(64)
    relu, neg = _call(torch.ops.aten.relu.default, x), _call(torch.ops.aten.neg.default, x)
    figures = {str(relu.func): iter([1.0, 100.0, 1.2]), str(neg.func): iter([2.0, 2.0, 100.0])}
    order = []

    def timed(call, cold=frozenset(), context=False):
        order.append(str(call.func))
        return next(figures[str(call.func)])

    timer = _timer(tmp_path, sweeps=3, cold=False)  # warm: one key per operator here
    monkeypatch.setattr(timer, "_run_timed", timed)
    times = [t.time_s for t in timer.time([relu, neg, relu, relu])]
    assert times == [1.2, 2.0, 1.2, 1.2]
    assert order == [str(relu.func), str(neg.func)] * 3  # sweeps over the calls, not runs in a row


def test_runs_are_timed_with_the_devices_clock(tmp_path, monkeypatch):
    """The timer reads the device layer's clock (with one torch thread on a CPU, the thread's CPU time,
    as the real profile's plain step is timed), not the wall clock: a clock that advances 0.5 s per read
    gives every run 0.5 s."""
    ticks = iter(range(1000))
    timer = _timer(tmp_path, sweeps=2, cold=False)
    monkeypatch.setattr(timer.layer, "clock", lambda: lambda: 0.5 * next(ticks))
    (timing,) = timer.time([_call(torch.ops.aten.relu.default, torch.rand(8))])
    assert timing.time_s == 0.5


def test_one_torch_thread_on_a_cpu_times_with_thread_cpu_time():
    import time

    from memplan.planner.probe.device import Device

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert Device().clock() is time.thread_time
        torch.set_num_threads(2)
        assert Device().clock() is time.perf_counter
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("a_shape, b_shape, grouped, flops", [((12, 8), (3, 8, 4), 12, 2 * 12 * 8 * 4),
                                                             ((8, 12), (12, 4), 12, 2 * 8 * 12 * 4),
                                                             ((3, 12, 8), (8, 12), 12, 2 * 12 * 8 * 12)])
def test_a_grouped_product_is_timed_on_every_row_and_its_flops_counted(a_shape, b_shape, grouped, flops):
    """Offsets filled with zeros (as integers are) make every group empty: a MoE layer's expert products
    were timed as no work. Materialised, the offsets split the grouped dimension evenly, and the product
    is each group's own: the forward's rows (2D x 3D), the weights' gradient (2D x 2D, per group of the
    contraction), 3D x 2D (per group of columns)."""
    func = torch.ops.aten._grouped_mm.default
    a, b = torch.rand(a_shape), torch.rand(b_shape)
    offs = torch.tensor([4, 8, grouped], dtype=torch.int32)  # the kernel wants 16-byte strides
    call = record_call(func, (a, b, offs), {}, func(a, b, offs))
    assert call.flops == flops
    assert op_class(call.name) == "matmul" and call.key.endswith("offs=even")
    args, _ = materialise(call, torch.device("cpu"))
    assert args[2].tolist() == [grouped // 3, 2 * grouped // 3, grouped]
    out = func(*args)
    bounds = [0, *args[2].tolist()]
    for g in range(3):
        rows = slice(bounds[g], bounds[g + 1])
        if len(a_shape) == 2 and len(b_shape) == 3:
            want = args[0][rows] @ args[1][g]
            got = out[rows]
        elif len(a_shape) == 2:
            want, got = args[0][:, rows] @ args[1][rows], out[g]
        else:
            want, got = args[0][g] @ args[1][:, rows], out[:, rows]
        assert torch.allclose(got, want, atol=1e-5) and got.abs().sum() > 0


@pytest.mark.usefixtures("one_thread")  # the timer's clock is then this thread's CPU time, as spin's
@pytest.mark.parametrize("bandwidth, charged_ms", [(2 * 2 * 16384 / 0.001, 3.0), (1.0, 10.0)])
def test_a_cold_call_is_charged_at_most_its_warm_time_plus_two_reads_of_its_cold_bytes(tmp_path, monkeypatch,
                                                                                        bandwidth, charged_ms):
    """The flush before a cold run costs a compute-bound call with small cold arguments more than the step
    pays for them (the GRU's weight-gradient products: twice their warm time): the charge is capped at
    the warm time plus two reads of the cold bytes at the bandwidth the flushes wrote at, and a call whose
    flushed time is under that cap keeps it. Here the call spins 10 ms when an argument was not touched
    since the last flush (the spare run touches its spare copies, not the timed ones) and 2 ms otherwise
    (the ceiling's warm runs, also those after a flush and a spare run on the same arguments: a CPU's
    step context); its two 16 KiB arguments are cold (new to the step). At a bandwidth that reads 64 KiB in 0.5 ms it is charged 2 + 1 ms; at 1 B/s the
    cap is far above and the flushed 10 ms stays."""
    import dataclasses

    def spin(seconds):  # in the timer's own clock (thread CPU time with one torch thread, else wall time)
        end = clock() + seconds
        while clock() < end:
            pass

    state = {"flushed": False, "cached": set()}

    def kernel(a, b):  # slow when an argument was not touched since the last flush (a cache of addresses)
        cold = state["flushed"] and not {a.data_ptr(), b.data_ptr()} <= state["cached"]
        state["cached"] |= {a.data_ptr(), b.data_ptr()}
        spin(0.010 if cold else 0.002)
        return torch.mm(a, b)

    a, b = torch.rand(64, 64), torch.rand(64, 64)
    call = dataclasses.replace(_call(torch.ops.aten.mm.default, a, b), func=kernel)
    timer = OpTimer(CPU, cache_dir=tmp_path, min_runs=3, target_s=0.0, sweeps=1)
    clock = timer.layer.clock()

    def flush():  # as the timer's flush: marks the cold arguments evicted and records its write rate
        state.update(flushed=True, cached=set())
        timer._flush_rates.append(bandwidth)

    monkeypatch.setattr(timer, "flush_caches", flush)
    monkeypatch.setattr(timer, "fault_cost_s", lambda: 0.0)
    (timing,) = timer.time([call])
    assert timing.time_s * 1e3 == pytest.approx(charged_ms, abs=0.4)


def test_each_cache_flush_measures_the_memory_bandwidth_it_wrote_at(tmp_path):
    """The cold charge's cap reads its bandwidth from the flushes themselves (no other buffer: a process
    under an address-space cap had no room for a second 64 MiB one, test_capped)."""
    timer = _timer(tmp_path)
    for _ in range(3):
        timer.flush_caches()
    assert len(timer._flush_rates) == 3 and all(1e8 < r < 1e13 for r in timer._flush_rates)


@pytest.mark.parametrize("siblings, l2_shared, core", [("0", "0", 2**20), ("0,64", "0,64", 2**20),
                                                        ("0", "0-1", 48 * 2**10)])
def test_a_cores_own_cache_is_the_largest_it_shares_only_with_its_own_hardware_threads(tmp_path, siblings,
                                                                                     l2_shared, core):
    """The step's context is decided against the core's own cache (its L2), read from /sys: on a machine
    with two hardware threads per core the L2 lists both, and is still the core's own; an L2 shared with
    another core is not (the L1 is then the core's own)."""
    from memplan.planner.probe.device import _cpu_cache_bytes

    (tmp_path / "topology").mkdir()
    (tmp_path / "topology" / "thread_siblings_list").write_text(siblings + "\n")
    for i, (size, shared) in enumerate([("48K", siblings), ("32K", siblings), ("1024K", l2_shared),
                                        ("32768K", "0-15,64-79")]):
        index = tmp_path / "cache" / f"index{i}"
        index.mkdir(parents=True)
        (index / "size").write_text(size + "\n")
        (index / "shared_cpu_list").write_text(shared + "\n")
    assert _cpu_cache_bytes(private=True, root=tmp_path) == core
    assert _cpu_cache_bytes(root=tmp_path) == 32 * 2**20


def test_kernel_scratch_lists_the_blocks_a_kernel_frees_inside_the_call_not_its_outputs():
    from memplan.planner.probe.optime import kernel_scratch, record_call

    x, w = torch.rand(2, 131, 16, 16), torch.rand(32, 131, 3, 3)
    conv = torch.ops.aten.convolution.default
    conv_args = (x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)
    calls = [record_call(conv, conv_args, {}, conv(*conv_args)),
             record_call(torch.ops.aten.add.Tensor, (x, x), {}, x + x)]
    found = kernel_scratch(calls, torch.device("cpu"))
    assert found[calls[1].key] == ()  # its one allocation is its output
    events = found[calls[0].key]
    allocated = [e for e in events if e > 0]
    assert allocated  # oneDNN's reorders of the input and the output into its blocked layouts
    assert sorted(-e - 1 for e in events if e < 0) == list(range(len(allocated)))  # each freed once
