"""``hlopass-dump``: show what hlopass does to a function.

    hlopass-dump FILE_OR_MODULE:FUNCTION --arg f32[1000,3] --arg f32[1000,3] \
        [--threshold SIZE] [--split-size SIZE] [--memory-limit SIZE] [--passes LIST] [--out DIR]
        [--format svg|png] [--explorer DIR] [--progress auto|on|off]

A misuse (bad target, argument spec, setting, folder) is one ``hlopass-dump: error:`` line and exit
status 2; an exception raised by the user's function prints the user's own frames and exits 1; so does
a program over the memory limit with ``HLOPASS_STRICT`` set. Never a traceback from inside hlopass.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import os
import re
import sys
import sysconfig
import time
import traceback

import jax
import jax.numpy as jnp

from hlopass import progress
from hlopass.errors import ConfigError
from hlopass.inspection import explorer
from hlopass.registry import builtin_folder

DTYPES = {
    "f16": jnp.float16, "bf16": jnp.bfloat16, "f32": jnp.float32, "f64": jnp.float64,
    "i8": jnp.int8, "i16": jnp.int16, "i32": jnp.int32, "i64": jnp.int64,
    "u8": jnp.uint8, "u32": jnp.uint32, "bool": jnp.bool_, "pred": jnp.bool_, "c64": jnp.complex64,
}
_SPEC_RE = re.compile(r"^\s*([a-z0-9]+)\s*\[\s*((?:[0-9]+\s*(?:,\s*[0-9]+\s*)*)?)\]\s*$", re.IGNORECASE)


class UsageError(Exception):
    """A problem with the command line, reported without a traceback."""


def parse_arg_spec(spec: str) -> jax.ShapeDtypeStruct:
    """``f32[1000,3]`` -> ``ShapeDtypeStruct((1000, 3), float32)``; ``i32[]`` is a scalar."""
    match = _SPEC_RE.match(spec)
    if not match or match.group(1).lower() not in DTYPES:
        raise UsageError(f"--arg {spec!r} is not an argument spec; expected DTYPE[D1,D2,...] with DTYPE one of "
                         f"{', '.join(DTYPES)} (e.g. f32[1000,3], i32[] for a scalar)")
    dims = [d.strip() for d in match.group(2).split(",")] if match.group(2).strip() else []
    dtype = DTYPES[match.group(1).lower()]
    if dtype in (jnp.float64, jnp.int64) and not jax.config.jax_enable_x64:
        jax.config.update("jax_enable_x64", True)
    return jax.ShapeDtypeStruct(tuple(int(d) for d in dims), dtype)


def load_function(target: str):
    """``path/to/file.py:name`` or ``package.module:name`` -> the function object."""
    if ":" not in target:
        raise UsageError(f"target {target!r} must be FILE_OR_MODULE:FUNCTION (e.g. train.py:kernel_matvec)")
    where, _, name = target.rpartition(":")
    if not where.strip() or not name.strip():
        raise UsageError(f"target {target!r} must be FILE_OR_MODULE:FUNCTION with both parts given "
                         "(e.g. train.py:kernel_matvec or mypackage.models:loss)")
    if where.endswith(".py") or os.path.exists(where):
        if not os.path.exists(where):
            raise UsageError(f"file {where!r} does not exist")
        sys.path.insert(0, os.path.dirname(os.path.abspath(where)))
        spec = importlib.util.spec_from_file_location("_hlopass_dump_target", where)
        module = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(module)
        except Exception as err:  # noqa: BLE001 - report the user's error plainly
            raise UsageError(f"importing {where!r} failed: {type(err).__name__}: {err}") from err
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as err:
            raise UsageError(f"cannot import module {where!r}: {err}") from err
        except Exception as err:  # noqa: BLE001 - report the user's error plainly
            raise UsageError(f"importing {where!r} failed: {type(err).__name__}: {err}") from err
    obj = module
    for part in name.split("."):
        if not hasattr(obj, part):
            available = sorted(n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n)))
            raise UsageError(f"{where!r} has no function {name!r}; callables there: {', '.join(available) or 'none'}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise UsageError(f"{target!r} is not callable")
    return obj


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hlopass-dump", description="Show what hlopass rewrites in a function "
                                     "and the memory before and after. Nothing is executed.",
                                     epilog="Exit status: 0 done; 1 the function raised (its own traceback is "
                                     "shown), or HLOPASS_STRICT is set and the program is over the memory limit; "
                                     "2 a bad target, argument spec, setting or folder.")
    parser.add_argument("target", help="FILE.py:FUNCTION or package.module:FUNCTION")
    parser.add_argument("--arg", action="append", default=[], metavar="SPEC",
                        help="an argument as DTYPE[DIMS], e.g. f32[1000,3]; repeat per argument")
    parser.add_argument("--threshold", help="HLOPASS_TENSOR_SIZE_THRESHOLD for this run (e.g. 100MB)")
    parser.add_argument("--split-size", help="HLOPASS_TENSOR_SPLIT_SIZE for this run")
    parser.add_argument("--memory-limit", help="HLOPASS_MEMORY_LIMIT for this run")
    parser.add_argument("--passes", help="HLOPASS_PASSES for this run (e.g. 'algebraic,split')")
    parser.add_argument("--out", default=None, help="folder to write the dump to (default: only print)")
    parser.add_argument("--no-compile", action="store_true", help="skip XLA compilation (no memory figures)")
    parser.add_argument("--format", choices=["text", "svg", "png"], default="text",
                        help="also draw pictures of the graph and memory (needs the 'plot' extra)")
    parser.add_argument("--progress", choices=["auto", "on", "off"], default="auto",
                        help="a progress bar of the passes on stderr (auto: when stderr is a terminal)")
    parser.add_argument("--explorer", metavar="DIR", default=None,
                        help="write the StableHLO before and after, with node data (bytes, rewriting pass, split "
                             "chunk), for Google's Model Explorer to DIR (needs the 'explorer' extra)")
    return parser


def main(argv=None) -> int:
    """Entry point of the ``hlopass-dump`` console script.

    Exit status 0 on success; 2 for a misuse (bad target, argument spec, setting or folder: one
    ``hlopass-dump: error:`` line); 1 when the user's function raised (its own frames are printed,
    not hlopass's) or, in strict mode, when the rewritten program is over the memory limit.
    """
    parser = build_parser()
    options = parser.parse_args(argv)
    try:
        from hlopass.api import HlopassFunction
        from hlopass.api import jit as hlopass_jit
        from hlopass.errors import MemoryLimitError
        from hlopass.inspection.dump import dump_explanation
        from hlopass.inspection.explanation import explain
        from hlopass.memory import enforce
        from hlopass.settings import check_folder

        if options.out is not None:
            check_folder(options.out, "--out")
        if options.explorer:
            explorer.require_model_explorer()
            explorer.prepare_folder(options.explorer)
        specs = [parse_arg_spec(s) for s in options.arg]
        fun = load_function(options.target)
        settings = {k: v for k, v in dict(threshold=options.threshold, split_size=options.split_size,
                                          memory_limit=options.memory_limit, passes=options.passes).items()
                    if v is not None}
        if isinstance(fun, HlopassFunction):
            function = hlopass_jit(fun._fun, **{**fun._overrides, **settings}, **fun._jit_kwargs)
        else:
            function = hlopass_jit(fun, **settings)
        config = function.config()
    except (UsageError, ConfigError, explorer.ExplorerError) as err:
        return _usage_error(err)
    bar = ProgressBar(sys.stderr) if options.progress == "on" or (
        options.progress == "auto" and sys.stderr.isatty()) else None
    try:
        with bar if bar is not None else contextlib.nullcontext():
            explanation = explain(function, *specs, compile=not options.no_compile, _config=config)
    except (UsageError, ConfigError, explorer.ExplorerError) as err:
        return _usage_error(err)
    except Exception as err:  # noqa: BLE001 - the user's function raised: say so, with their frames
        return _user_error(options.target, len(specs), err)
    print(explanation.summary())
    status = 0
    if options.out:
        try:
            folder = dump_explanation(explanation, options.out, subfolder=False)
        except OSError as err:
            return _usage_error(f"--out {options.out!r}: cannot write the dump: {err}")
        if options.format != "text":
            try:
                from hlopass.inspection.draw import draw_explanation
                draw_explanation(explanation, folder, options.format)
            except ImportError as err:
                print(f"hlopass-dump: pictures need the 'plot' extra (pip install hlopass[plot]): {err}",
                      file=sys.stderr)
        print(f"dump written to {folder}")
    if options.explorer:
        from hlopass.never_worse import inspecting
        try:
            with inspecting():  # the memory figures are reported below
                explorer.write_explorer(options.explorer, function, *specs, config=explanation.config)
        except explorer.ExplorerError as err:
            return _usage_error(err)
        print(f"Model Explorer files written to {options.explorer}; open them with: "
              f"{explorer.open_command(options.explorer)}")
    if explanation.memory_after is not None:
        try:
            enforce(explanation.memory_after, config.strict)
        except MemoryLimitError as err:
            print(f"hlopass-dump: error: {err}", file=sys.stderr)
            status = 1
    return status


class ProgressBar:
    """A one-line bar on ``stream`` while the passes run: each program, the pass running (k of n),
    its time and region (from :mod:`hlopass.progress`); redrawn in place, at most ten times a second
    for region changes."""

    WIDTH = 20

    def __init__(self, stream, width: int = 110):
        self.stream = stream
        self.width = width
        self.drawn = False
        self._last = 0.0

    def __enter__(self) -> "ProgressBar":
        progress.listeners.append(self)
        return self

    def __exit__(self, *exc) -> None:
        progress.listeners.remove(self)
        if self.drawn:
            self.stream.write("\n")
            self.stream.flush()

    def __call__(self, work: progress.Work, event: str) -> None:
        now = time.perf_counter()
        if event == "region" and now - self._last < 0.1:
            return
        self._last = now
        n = len(work.passes)
        done = n if event == "done" else max(work.index, 0)
        filled = self.WIDTH * done // max(n, 1)
        bar = "#" * filled + "." * (self.WIDTH - filled)
        if event == "done":
            what = f"done in {now - work.started:.1f} s"
        elif work.current_pass is None:
            what = "starting"
        else:
            what = f"{work.current_pass} ({now - work.pass_started:.1f} s) at {work.region()}"
        line = f"hlopass-dump: {work.label}: passes [{bar}] {done}/{n} {what}"
        self.stream.write("\r" + line[:self.width].ljust(self.width))
        self.stream.flush()
        self.drawn = True


def _usage_error(err) -> int:
    print(f"hlopass-dump: error: {err}", file=sys.stderr)
    return 2


#: Frames from these folders are hlopass's, JAX's or Python's, not the user's.
_INTERNAL_FOLDERS = tuple(os.path.abspath(p) + os.sep for p in {
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))),  # hlopass/
    sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"],
})


def _user_frames(err: BaseException) -> list:
    frames = traceback.extract_tb(err.__traceback__)
    passes_folder = builtin_folder()
    return [f for f in frames if not os.path.abspath(f.filename).startswith(_INTERNAL_FOLDERS)
            and not os.path.abspath(f.filename).startswith(passes_folder + os.sep)
            and os.path.abspath(f.filename) != os.path.abspath(__file__)]


def _user_error(target: str, n_args: int, err: BaseException) -> int:
    frames = _user_frames(err)
    if not frames and isinstance(err, TypeError):  # the call itself did not fit the function
        return _usage_error(f"calling {target} with {n_args} argument(s) failed: {err}")
    if frames:
        print("Traceback of your code (most recent call last):", file=sys.stderr)
        print("".join(traceback.format_list(frames)).rstrip("\n"), file=sys.stderr)
    print(f"hlopass-dump: error: {target} raised {type(err).__name__}: {err}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
