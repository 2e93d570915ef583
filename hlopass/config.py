"""The settings one function is compiled with (:class:`Config`), and their defaults.

Reading them from the environment and keywords is :mod:`hlopass.settings`.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import resource
from typing import Any

from hlopass.sizes import format_size

#: The default threshold is this fraction of the memory limit, within the bounds below:
#: several split loops' buffers and the inputs must fit at once.
DEFAULT_THRESHOLD_FRACTION = 1 / 20
DEFAULT_THRESHOLD_MIN = 2**20
DEFAULT_THRESHOLD_MAX = 2**30
#: Products are reordered only when that cuts their multiply-adds by at least this factor: below
#: it, the order as written (and its rounding) is kept.
DEFAULT_MIN_GAIN = 1.25


@dataclasses.dataclass(frozen=True)
class Config:
    """The settings one function is compiled with (hashable: part of the cache key).

    ``threshold``/``split_size``/``memory_limit`` are bytes, or ``None`` for "off";
    ``passes`` holds :class:`~hlopass.pass_base.Pass` instances, in pipeline order.
    """

    threshold: int | None
    split_size: int | None
    memory_limit: int | None
    passes: tuple[Any, ...] = ()
    dump_to: str | None = None
    strict: bool = False
    #: A reordering (matrix_chain) must cut the multiply-adds by at least this factor.
    min_gain: float = DEFAULT_MIN_GAIN
    #: When the passes change a program but cannot bound it, keep the original if XLA says it needs
    #: less memory (see :mod:`hlopass.never_worse`); off: always run the rewritten program.
    never_worse: bool = True

    @property
    def pass_names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.passes)

    def describe(self) -> str:
        """One line for logs and dumps."""
        passes = ",".join(repr(p) if _configured(p) else p.name for p in self.passes) or "none"
        return (f"threshold={format_size(self.threshold)} split_size={format_size(self.split_size)} "
                f"memory_limit={format_size(self.memory_limit)} passes={passes}"
                + ("" if self.never_worse else " never_worse=off"))


def _configured(pass_) -> bool:
    """Whether a pass runs with options other than its defaults."""
    return pass_.options != type(pass_.options)()


@functools.lru_cache(maxsize=None)
def device_memory_bytes() -> int:
    """Memory available to the default device: the accelerator's allocator limit,
    or on CPU the physical memory capped by the address-space limit (``ulimit -v``)."""
    import jax
    device = jax.devices()[0]
    try:
        stats = device.memory_stats() or {}
    except Exception:  # noqa: BLE001 - backends without memory stats
        stats = {}
    if stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        physical = min(physical, soft)
    return int(physical)


def default_threshold(memory_limit: int | None) -> int:
    """The threshold used when none is set: a twentieth of the memory limit, between 1 MiB and 1 GiB."""
    base = memory_limit if memory_limit is not None else device_memory_bytes()
    return int(min(DEFAULT_THRESHOLD_MAX, max(DEFAULT_THRESHOLD_MIN, base * DEFAULT_THRESHOLD_FRACTION)))
