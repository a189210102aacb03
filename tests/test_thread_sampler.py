"""benchmarks/thread_sampler.py (first_call_profile --sample-main): the main thread's stacks are
sampled from another thread and summarised per time slice."""
import time

from benchmarks.thread_sampler import MainThreadSampler


def _waiting_in_sleep(seconds):
    time.sleep(seconds)  # a C call that holds no Python frame of its own: the caller's frame shows


def test_samples_show_where_the_main_thread_waits():
    t0 = time.perf_counter()
    sampler = MainThreadSampler(interval=0.002).start()
    _waiting_in_sleep(0.15)
    sampler.stop()
    stacks = [stack for _, stack in sampler.samples]
    assert stacks and sum("_waiting_in_sleep" in stack[0] for stack in stacks) >= len(stacks) // 2
    lines = sampler.slices(t0, width=0.1)
    assert lines and "_waiting_in_sleep" in lines[0]
