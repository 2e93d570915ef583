"""What the scripts in ``tools/`` share: timing, XLA's memory figures, differences, capped child runs,
JSON and Markdown writers and a progress bar.

Run the scripts as modules from the repository's root (``python -m tools.bench_x``): ``tools`` is a
package, so ``from tools import harness`` and ``from fixtures import ...`` need no ``sys.path`` edits.
A child process started by :func:`run_capped` runs ``python -m tools.<name>`` with the root on its
``PYTHONPATH``, from any folder.

- **Timing** (:func:`time_calls`): the columns of a comparison are called in interleaved rounds, the
  order rotating each round, so that the load of a shared machine hits every column alike and no
  column always follows the same one (a call right after a large one runs slower). Each column gets a
  :class:`Timing` (wall and process CPU time of every call, the warm-up call's output and time): its
  ``median`` or ``best``, and :func:`ratio` between columns. :func:`time_call` is one column alone;
  :func:`stopwatch` times a block (compiles).
- **Memory** (:func:`memory_figures`, :func:`temp_bytes`): ``compile().memory_analysis()``.
- **Differences** (:func:`relative_difference` of outputs, :func:`sample` and
  :func:`sample_difference` of outputs a child reports).
- **Children** (:func:`run_capped`, :func:`module_argv`, :func:`cap_address_space`,
  :func:`report_result`, :func:`short_error`): a child under an address-space cap reports one JSON line.
- **Writers** (:func:`write_json`, :func:`markdown_table`) and :func:`progress`.

Nothing here imports JAX at module level (the peer-test plugin and the capped parents import this).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import resource
import statistics
import sys
import time
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np

#: The repository's root folder.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: Where the benchmarks write their figures (the documentation reads them).
RESULTS = os.path.join(ROOT, "tools", "results")


# -- timing ------------------------------------------------------------------------------------------

def block(out):
    """``jax.block_until_ready(out)``."""
    import jax
    return jax.block_until_ready(out)


@dataclasses.dataclass
class Timing:
    """The timed calls of one column: wall and process CPU seconds of each (CPU: all threads, steadier than
    the wall clock on a loaded machine), and the warm-up call's output and seconds (``first``)."""

    wall: list[float] = dataclasses.field(default_factory=list)
    cpu: list[float] = dataclasses.field(default_factory=list)
    first: float | None = None
    out: Any = None

    @property
    def median(self) -> float:
        return statistics.median(self.wall)

    @property
    def median_cpu(self) -> float:
        return statistics.median(self.cpu)

    @property
    def best(self) -> float:
        return min(self.wall)


class _Clock:
    seconds: float = 0.0


@contextlib.contextmanager
def stopwatch() -> Iterator[_Clock]:
    """``with stopwatch() as clock: ...``; then ``clock.seconds`` is the block's wall time."""
    clock, start = _Clock(), time.perf_counter()
    try:
        yield clock
    finally:
        clock.seconds = time.perf_counter() - start


def compile_timed(jitted, args: Sequence) -> tuple[Any, Any, float]:
    """``(lowered, compiled, seconds)`` of lowering and compiling ``jitted`` at ``args``."""
    with stopwatch() as clock:
        lowered = jitted.lower(*args)
        compiled = lowered.compile()
    return lowered, compiled, clock.seconds


def timed(fn: Callable[[], Any]) -> tuple[Any, float, float]:
    """One call of ``fn()``, blocked until ready: ``(output, wall seconds, process CPU seconds)``."""
    wall, cpu = time.perf_counter(), time.process_time()
    out = block(fn())
    return out, time.perf_counter() - wall, time.process_time() - cpu


def time_calls(fns: dict[str, Callable[[], Any]], repeat: int = 3, budget_s: float = 0.0, warmup: bool = True,
               rotate: bool = True, max_rounds: int = 100, label: str | None = None) -> dict[str, Timing]:
    """Time the columns ``fns`` (name -> a call without arguments) side by side.

    After one warm-up call of each (in order; its output and time kept in the :class:`Timing`), the columns
    are called in rounds, every column once a round, the order rotated by one each round (``rotate``). At
    least ``repeat`` rounds; while the slowest column has used less than ``budget_s`` seconds, more (fast
    calls repeat until the budget, ``max_rounds`` at the most). ``label`` shows a progress bar.
    """
    timings = {name: Timing() for name in fns}
    if warmup:
        for name, fn in fns.items():
            timings[name].out, timings[name].first, _ = timed(fn)
    names = list(fns)
    bar = Progress(repeat, label) if label else None
    rounds = 0
    while rounds < repeat or (max(sum(t.wall) for t in timings.values()) < budget_s and rounds < max_rounds):
        shift = rounds % len(names) if rotate and names else 0
        for name in names[shift:] + names[:shift]:
            _, wall, cpu = timed(fns[name])
            timings[name].wall.append(wall)
            timings[name].cpu.append(cpu)
        rounds += 1
        if bar:
            bar.update()
    if bar:
        bar.close()
    return timings


def time_call(fn: Callable[[], Any], repeat: int = 3, budget_s: float = 0.0, warmup: bool = True) -> Timing:
    """:func:`time_calls` of one column."""
    return time_calls({"": fn}, repeat, budget_s, warmup)[""]


def ratio(numerator: float | None, denominator: float | None, floor: float = 0.0) -> float | None:
    """``numerator / max(denominator, floor)``; ``None`` when either is missing or the denominator is 0."""
    if numerator is None or denominator is None:
        return None
    denominator = max(denominator, floor)
    return numerator / denominator if denominator else None


# -- XLA's memory figures --------------------------------------------------------------------------

def memory_figures(compiled) -> dict[str, int | None]:
    """XLA's ``memory_analysis()`` of a compiled program: temp, argument and output bytes (``None`` where
    the backend gives no analysis)."""
    analysis = compiled.memory_analysis()

    def figure(name):
        value = getattr(analysis, name, None) if analysis is not None else None
        return None if value is None else int(value)
    return {"temp": figure("temp_size_in_bytes"), "arguments": figure("argument_size_in_bytes"),
            "outputs": figure("output_size_in_bytes")}


def temp_bytes(fn, args: Sequence = (), quiet: bool = False) -> int | None:
    """XLA temp bytes of ``fn`` (compiled, or jitted and then compiled at ``args``); ``quiet``: ``None``
    instead of an error."""
    try:
        compiled = fn if hasattr(fn, "memory_analysis") else fn.lower(*args).compile()
        return memory_figures(compiled)["temp"]
    except Exception:  # noqa: BLE001 - a figure the caller can do without
        if quiet:
            return None
        raise


def columns_figures(columns: dict[str, Any], args: Sequence, repeat: int = 5, budget_s: float = 1.0) -> dict:
    """Jitted ``columns`` (name -> function) at ``args`` side by side: ``{name}_s`` (best call of
    :func:`time_calls`) for each, then ``temp_{name}_bytes`` for each."""
    timings = time_calls({name: functools.partial(fn, *args) for name, fn in columns.items()}, repeat, budget_s)
    return {**{f"{name}_s": timings[name].best for name in columns},
            **{f"temp_{name}_bytes": temp_bytes(fn, args) for name, fn in columns.items()}}


# -- differences --------------------------------------------------------------------------------------

def relative_difference(got, want, per_leaf: bool = True, floor: float = 1e-30) -> float:
    """Largest ``|got - want|`` relative to ``want``'s largest magnitude, over pytrees of arrays: each leaf
    against its own scale (``per_leaf``) or all leaves together."""
    import jax
    gots = [np.asarray(g, np.float64).ravel() for g in jax.tree_util.tree_leaves(got)]
    wants = [np.asarray(w, np.float64).ravel() for w in jax.tree_util.tree_leaves(want)]
    if not per_leaf:
        gots, wants = [np.concatenate(gots)], [np.concatenate(wants)]
    return max(float(np.max(np.abs(g - w), initial=0.0)) / max(float(np.max(np.abs(w), initial=0.0)), floor)
               for g, w in zip(gots, wants))


def sample(out, size: int) -> list[list[float]]:
    """About ``size`` evenly spaced entries of each leaf of ``out``, as float lists (a child reports them)."""
    import jax
    return [np.asarray(leaf, np.float64).ravel()[:: max(1, np.size(leaf) // size)][:size].tolist()
            for leaf in jax.tree_util.tree_leaves(out)]


def sample_difference(a, b, finite: bool = False, floor: float = 1e-30) -> float | None:
    """:func:`relative_difference` of two :func:`sample` s (``None`` when they do not line up); ``finite``:
    only where ``b`` is finite."""
    if a is None or b is None or len(a) != len(b):
        return None
    worst = 0.0
    for x, y in zip(a, b):
        x, y = np.asarray(x), np.asarray(y)
        if x.shape != y.shape:
            return None
        if finite:
            x, y = x[np.isfinite(y)], y[np.isfinite(y)]
        scale = max(float(np.max(np.abs(y), initial=0.0)), floor)
        worst = max(worst, float(np.max(np.abs(x - y), initial=0.0)) / scale)
    return worst


# -- child processes ------------------------------------------------------------------------------------

def module_argv(module: str, *args: str) -> list[str]:
    """``-m tools.<module> args...`` for :func:`run_capped` (``module``: ``bench_x`` or ``tools.bench_x``)."""
    return ["-m", module if module.startswith("tools.") else f"tools.{module}", *args]


def run_capped(argv: list[str], cap_bytes: int | None, timeout: float = 600, env: dict | None = None,
               platforms: str | None = "cpu", keep: Iterable[str] = ("process_seconds", "peak_rss_bytes")) -> dict:
    """Run ``python argv...`` (e.g. :func:`module_argv`) in a child under an address-space cap of
    ``cap_bytes`` (``None``: none) with the root on its ``PYTHONPATH``, and return the JSON the child
    reports with :func:`report_result` (``{"status": "crashed" | "timeout", "error": ...}`` when it reports
    nothing). ``platforms``: the child's ``JAX_PLATFORMS`` (``None``: this process's). ``keep``: which of
    the figures added around the child's own (its process seconds, its peak RSS) stay in the result."""
    child_env = {"PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p),
                 "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "") if platforms is None else platforms,
                 **(env or {})}
    from hlopass.inspection import demo
    result = demo.run_capped(argv, cap_bytes, timeout=timeout, env=child_env)
    for name in {"process_seconds", "peak_rss_bytes"} - set(keep):
        result.pop(name, None)
    return result


def report_result(result: dict) -> None:
    """In a child: print ``result`` (with the child's peak RSS) as the line :func:`run_capped` reads."""
    from hlopass.inspection import demo
    demo.report_result(result)


def short_error(err: BaseException) -> str:
    """The first line of an error that says what ran out (``RESOURCE_EXHAUSTED: ...``)."""
    from hlopass.inspection import demo
    return demo.short_error(err)


def cap_address_space(cap_bytes: int) -> None:
    """Cap this process's address space (``RLIMIT_AS``) at ``cap_bytes``: call it before JAX starts."""
    resource.setrlimit(resource.RLIMIT_AS, (cap_bytes, cap_bytes))


# -- writers ----------------------------------------------------------------------------------------------

def write_json(path: str | os.PathLike | None, data, indent: int = 2, **kwargs) -> None:
    """``json.dump(data)`` to ``path`` (nothing when ``path`` is ``None``), its folder made if needed."""
    if not path:
        return
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    with open(path, "w") as handle:
        json.dump(data, handle, indent=indent, **kwargs)


def write_csv(path: str, rows: Iterable[dict], fields: Sequence[str]) -> None:
    """``rows`` as CSV with the columns ``fields`` (other keys left out, missing ones empty)."""
    import csv
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


def without(rows: Iterable[dict], *keys: str) -> list[dict]:
    """``rows`` without ``keys`` (e.g. the output samples before writing JSON)."""
    return [{k: v for k, v in row.items() if k not in keys} for row in rows]


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A Markdown table: ``| a | b |``, ``|---|---|`` and one line a row (cells as ``str``)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def text_table(header: str, lines: Iterable[str]) -> str:
    """A fixed-width text table: the header, a rule as long as it, then the lines."""
    return "\n".join([header, "-" * len(header), *lines])


# -- progress -----------------------------------------------------------------------------------------------

class Progress:
    """A one-line textual progress bar on stderr, shown only when stderr is a terminal (and
    ``HLOPASS_PROGRESS`` is not ``0``), so logs and captured output stay as they were."""

    def __init__(self, total: int, label: str = "", stream=None, width: int = 24):
        self.total, self.label, self.done, self.width = max(total, 1), label, 0, width
        self.stream = stream or sys.stderr
        self.shown = (os.environ.get("HLOPASS_PROGRESS", "1") != "0"
                      and getattr(self.stream, "isatty", lambda: False)())
        self.start = time.perf_counter()
        self._draw()

    def update(self, steps: int = 1, note: str = "") -> None:
        self.done += steps
        self._draw(note)

    def _draw(self, note: str = "") -> None:
        if not self.shown:
            return
        filled = min(self.width, self.width * self.done // self.total)
        elapsed = time.perf_counter() - self.start
        self.stream.write(f"\r{self.label} [{'#' * filled}{'.' * (self.width - filled)}] {self.done}/{self.total} "
                          f"{elapsed:.0f} s {note[:40]}\033[K")
        self.stream.flush()

    def close(self) -> None:
        if self.shown:
            self.stream.write("\r\033[K")
            self.stream.flush()


def progress(items: Iterable, label: str = "", total: int | None = None) -> Iterator:
    """``items`` with a :class:`Progress` bar advanced after each."""
    items = list(items) if total is None else items
    bar = Progress(len(items) if total is None else total, label)
    try:
        for item in items:
            yield item
            bar.update()
    finally:
        bar.close()
