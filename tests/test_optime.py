"""Op timing alone (planner/probe/optime.py): which arguments a call finds cold in the step, the cache's
keys (call, cold arguments, timing method, device and torch version), and the cold-timing path. Each
test uses a temporary cache directory and calls small enough to time in milliseconds."""

import torch

from memplan.planner.probe.optime import (
    OpTimer,
    cold_arguments,
    device_identity,
    last_level_cache_bytes,
    record_call,
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
    timer = OpTimer(CPU, cache_dir=tmp_path, min_runs=3, target_s=0.0)
    monkeypatch.setattr(timer, "flush_caches", lambda: flushes.append(1))
    timer.time([first])
    assert len(flushes) == 3  # one per timed run
    flushes.clear()
    timer.time([first, second])  # the relu is cached now; the neg finds x hot
    assert timer.stats.cache_hits == 1 and not flushes


def test_the_flush_buffer_outsizes_the_last_level_cache(tmp_path):
    cache_bytes = last_level_cache_bytes(CPU)
    assert cache_bytes >= 2**16
    timer = _timer(tmp_path)
    assert timer.flush_bytes == 2 * cache_bytes
    timer.flush_caches()  # allocates and writes it
