"""Intra-op threads of a CPU job.

`torch_threads(n)`: run a job with `n` intra-op threads and restore the caller's count after
(`trainer.num_threads`, `regenerate.num_threads`, the runner's `num_threads`). A job called in-process (tests, a notebook)
must not leave its thread count behind: CPU reductions split by thread count, so a later run
in the same process would give slightly different numbers.

`auto_threads()`: the count a command-line job picks when the config leaves it unset (null):
as many threads as the machine has idle CPUs when the job starts, at least one. Why: torch's
intra-op threads meet at a barrier after every parallel region, so when another process holds
a core, each region waits for the thread that was descheduled, and a job with two threads on
two cores beside two busy processes ran 4.7x slower than idle where a fair share of the cores
costs about 2x (docs/results.md, "CPU main job under load"). One thread per idle core keeps
the job's slowdown in proportion to the load. The command-line entry points resolve the count
once, print it and record it in the resolved config (a run's numbers depend on it at the 1e-5
level), so a run is reproducible with `trainer.num_threads=<n>`; `train(cfg)` called directly
never guesses.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def torch_threads(n: int | None) -> Iterator[None]:
    before = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _cpu_times() -> tuple[float, float] | None:
    """(idle, total) jiffies of all CPUs from /proc/stat; None where there is none."""
    try:
        with open("/proc/stat") as f:
            fields = [float(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0.0)  # idle + iowait
    return idle, sum(fields[:8])


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def idle_cpus(sample_s: float = 0.5) -> float | None:
    """How many CPUs were idle over the next `sample_s` seconds (machine-wide, counted in
    CPUs of this process's affinity); None where the kernel does not say (not Linux)."""
    a = _cpu_times()
    if a is None:
        return None
    time.sleep(sample_s)
    b = _cpu_times()
    if b is None or b[1] <= a[1]:
        return None
    machine = os.cpu_count() or 1
    idle = (b[0] - a[0]) / (b[1] - a[1]) * machine
    return min(idle, float(usable_cpus()))


def resolve_cli_threads(n: int | None, who: str) -> int | None:
    """The intra-op thread count a command-line job runs with: `n` when the config sets it;
    on a CPU-only machine, `auto_threads()` shared among the launcher's processes
    (`WORLD_SIZE`), printed to stderr; None (torch's default) on a CUDA machine."""
    import sys

    if n is not None or torch.cuda.is_available():
        return n
    world = max(1, int(os.environ.get("WORLD_SIZE", "1")))
    auto, why = auto_threads()
    n = max(1, auto // world)
    print(f"{who}: {why}; set {who}.num_threads to fix it", file=sys.stderr)
    return n


def auto_threads(sample_s: float = 0.5) -> tuple[int, str]:
    """(intra-op threads, why): one per idle CPU, at least 1 and at most the usable CPUs
    (torch's own default where the load cannot be read)."""
    cpus = usable_cpus()
    idle = idle_cpus(sample_s)
    if idle is None:
        n = torch.get_num_threads()
        return n, f"{n} intra-op threads (torch's default; the machine's load is unknown)"
    n = max(1, min(cpus, int(idle + 0.3)))
    return n, f"{n} intra-op thread{'s' * (n > 1)} ({idle:.1f} of {cpus} CPUs idle)"


# glibc `mallopt` parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4


def retain_freed_memory() -> bool:
    """Serve every allocation from the heap and keep freed memory for reuse (glibc only;
    False elsewhere, nothing changed). Why: glibc maps each allocation above 32 MiB afresh and
    unmaps it on free, so a CPU job whose tensors are that large (the runner's `[rows, vocab]`
    sampling temporaries, a batch of thousands of requests) page-faults its way through every
    op: in `tests/infer/test_lossless_sampling.py`'s 11,000-request run 84 of 107 s were
    kernel time, 17 s with this (wall 107 -> 58 s, peak memory 9.0 -> 10.6 GB). The cost is
    that memory freed by the process is not returned to the system before it exits."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS)
        return False
    ok = mallopt(_M_MMAP_MAX, 0) == 1
    # The largest C int: only a free top of heap above 2 GiB goes back to the system.
    return ok and mallopt(_M_TRIM_THRESHOLD, 2**31 - 1) == 1
