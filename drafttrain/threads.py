"""`torch_threads(n)`: run a job with `n` intra-op threads and restore the caller's count
after (`trainer.num_threads`, `regenerate.num_threads`). A job called in-process (tests, a
notebook) must not leave its thread count behind: CPU reductions split by thread count, so
a later run in the same process would give slightly different numbers."""

from __future__ import annotations

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
