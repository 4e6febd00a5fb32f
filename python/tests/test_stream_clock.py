"""``hprt.StreamClock``: hprt's one stream clock (the one ``hprt trace`` and
``hprt.fsdp.StreamTrace`` time streams with) puts points of a stream on
``time.perf_counter()``'s clock."""

import time

import pytest

import hprt


def test_a_mark_after_a_host_side_delay_is_later_on_the_perf_counter_clock():
    platform = hprt.cpu_platform()
    stream = platform.create_stream()
    clock = hprt.StreamClock(platform)
    t0 = time.perf_counter()
    before = clock.mark(stream)
    time.sleep(0.03)
    slept = time.perf_counter()
    after = clock.mark(stream)
    stream.synchronize()
    t1 = time.perf_counter()
    assert before.reached() and after.reached()
    a, b = before.seconds(), after.seconds()
    # The same clock as perf_counter: each mark lies between the timestamps taken around it,
    # give or take the clock's calibration error (wider on a loaded host).
    slack = 1e-4 + after.uncertainty_s()
    assert t0 - slack <= a < b, (t0, a, b)
    assert slept - slack <= b <= t1 + slack, (slept, b, t1)
    assert after.try_seconds() == b
    assert t1 <= hprt.StreamClock.now() <= time.perf_counter()


def test_stream_trace_spans_come_from_the_stream_clock():
    """``hprt.fsdp.StreamTrace`` brackets stream work with marks and returns its spans with the
    host waits, sorted, on perf_counter's clock."""
    fsdp = pytest.importorskip("hprt.fsdp")  # it imports torch
    platform = hprt.cpu_platform()
    stream = platform.create_stream()
    trace = fsdp.StreamTrace(platform)
    t0 = time.perf_counter()
    start = trace.begin(stream)
    time.sleep(0.01)
    slept = time.perf_counter()
    trace.end("all-gather", stream, start)
    w0 = time.perf_counter()
    stream.synchronize()
    trace.wait(w0, time.perf_counter())
    spans = trace.spans()
    assert [k for k, _, _ in spans] == ["all-gather", "wait"]
    (_, a0, a1), (_, s0, s1) = spans
    slack = 1e-4 + trace.begin(stream).uncertainty_s()
    assert t0 - slack <= a0 < a1 <= s1 + slack, (t0, a0, a1, s1)
    assert a1 >= slept - slack, (slept, a1)
