"""MkDocs hook: the parts of the docs that are generated at build time, never copied by hand.

A page asks for a generated block with a marker comment on a line of its own::

    <!-- generated: NAME -->

and the hook replaces it with ``GENERATORS[NAME]()`` (run once per build, in ``on_files``). The sources:

- ``architecture``: the import-linter contracts of ``pyproject.toml`` (``[tool.importlinter]``),
  drawn as a mermaid diagram (Material renders mermaid in the browser) with a table of the contracts;
- ``bench_*``: the benchmark results in ``tools/results/`` (JSON written by the ``tools/bench_*.py``
  scripts, and ``results.md`` written by ``tools/bench_suite.py``), as tables, with plots drawn by
  matplotlib into the site (``generated/*.png``);
- ``dump_*``: a real dump of ``fixtures/kernels.py:kernel_matvec`` made by ``hlopass-dump`` during the
  build (its report and its pictures).

An unknown marker, a missing results file or a failed dump raises, so ``mkdocs build --strict`` fails.
"""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESULTS = os.path.join(ROOT, "tools", "results")
MARKER = re.compile(r"^<!-- generated: ([a-z_]+) -->$", re.MULTILINE)

#: Files the generators produce for the site: site path -> bytes (added in ``on_files``).
_ASSETS: dict[str, bytes] = {}


# ---------------------------------------------------------------- helpers

def _load(name: str):
    with open(os.path.join(RESULTS, name)) as handle:
        return json.load(handle)


def _bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def _s(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds:.3g} s"


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _source(*names: str) -> str:
    files = ", ".join(f"`tools/results/{n}`" for n in names)
    return f"\n\n*Generated at build time from {files}.*\n"


def _plot(name: str, draw) -> str:
    """Draw a matplotlib figure with ``draw(fig)`` into the site as ``generated/NAME.png``; return its link."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = plt.figure(figsize=(8, 3.6), dpi=100)
    draw(fig)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    plt.close(fig)
    _ASSETS[f"generated/{name}.png"] = buffer.getvalue()
    return f"![{name}](@ROOT@generated/{name}.png)"


# ---------------------------------------------------------------- architecture

def _contracts() -> dict:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as handle:
        return tomllib.load(handle)["tool"]["importlinter"]


def architecture() -> str:
    linter = _contracts()
    contracts = linter["contracts"]
    out = ["```mermaid", "flowchart TB"]
    layers = next(c for c in contracts if c["type"] == "layers")
    container = layers["containers"][0]
    previous = None
    for i, layer in enumerate(layers["layers"]):
        names = [n.strip() for n in layer.split(":")]
        node = f"L{i}"
        label = "<br/>".join(f"{container}.{n}" for n in names)
        out.append(f'  {node}["{label}"]')
        if previous:
            out.append(f"  {previous} --> {node}")
        previous = node
    independent = next((c for c in contracts if c["type"] == "independence"), None)
    if independent:
        out.append('  subgraph P["passes (installed as hlopass.passes): independent of each other"]')
        out.append("    direction LR")
        for j, module in enumerate(independent["modules"]):
            out.append(f'    P{j}["{module}"]')
        out.append("  end")
    forbidden = next((c for c in contracts if c["type"] == "forbidden"), None)
    if forbidden:
        allowed = [i for i, layer in enumerate(layers["layers"])
                   if not any(f"{container}.{n.strip()}" in forbidden["forbidden_modules"]
                              for n in layer.split(":"))]
        out.append(f"  P --> L{allowed[0]}")
    out.append("```")
    out.append("")
    out.append("Arrows point from a layer to the layers it may import; a layer never imports one above it. "
               "Names on one line of a box (`a : b`) are siblings of one layer that do not import each other.")
    out.append("")
    rows = []
    for c in contracts:
        if c["type"] == "layers":
            what = " > ".join(f"`{layer}`" for layer in c["layers"])
        elif c["type"] == "independence":
            what = ", ".join(f"`{m}`" for m in c["modules"])
        elif c["type"] == "forbidden":
            what = (", ".join(f"`{m}`" for m in c["source_modules"]) + " must not import "
                    + ", ".join(f"`{m}`" for m in c["forbidden_modules"]))
        else:
            what = ", ".join(f"`{k}` = `{v}`" for k, v in c.items() if k not in ("name", "type"))
        rows.append([c["name"], f"`{c['type']}`", what])
    out.append(_table(["contract", "type", "modules"], rows))
    out.append("\n*Generated at build time from `[tool.importlinter]` in `pyproject.toml`.*\n")
    return "\n".join(out)


# ---------------------------------------------------------------- benchmarks

def bench_suite() -> str:
    with open(os.path.join(RESULTS, "results.md")) as handle:
        table = handle.read().strip()
    data = _load("results.json")
    by = {}
    for r in data["results"]:
        by.setdefault(r["workload"], {})[r["column"]] = r

    def draw(fig):
        names = [w for w in by if "plain" in by[w] and "hlopass" in by[w]
                 and by[w]["plain"].get("median_seconds") and by[w]["hlopass"].get("median_seconds")]
        time_ratio = [by[w]["plain"]["median_seconds"] / by[w]["hlopass"]["median_seconds"] for w in names]
        temp_ratio = [by[w]["plain"]["xla_temp_bytes"] / max(by[w]["hlopass"]["xla_temp_bytes"], 1) for w in names]
        for k, (values, title) in enumerate(((time_ratio, "time, plain / hlopass"),
                                             (temp_ratio, "XLA temp, plain / hlopass"))):
            ax = fig.add_subplot(1, 2, k + 1)
            ax.barh(names, values, color="tab:orange")
            ax.set_xscale("log")
            ax.axvline(1, color="black", lw=0.8)
            ax.set_title(title + " (log; > 1 favours hlopass)", fontsize=9)
            ax.tick_params(labelsize=8)
            if k:
                ax.set_yticklabels([])

    return (table + "\n\n" + _plot("bench_suite", draw)
            + _source("results.md", "results.json"))


def bench_knn_speed() -> str:
    data = _load("knn_speed.json")
    cols = [("plain", "plain `jax.jit`"), ("hand", "`lax.map` by hand"), ("keops", "KeOps"),
            ("hlopass", "hlopass"), ("hlopass, one-level top_k", "hlopass, one-level `top_k`"),
            ("hlopass, no unroll", "hlopass without unrolling")]
    rows = []
    for r in data["rows"]:
        cells = [f"{r['kind'].upper()} {r['queries']:,} × {r['points']:,}, d = {r['d']}"]
        for key, _ in cols:
            c = r.get(key)
            cells.append(f"{c['wall_s']:.2f} s ({c['cpu_s']:.2f})" if c else "-")
        h = r["hlopass"]["wall_s"]
        cells.append(f"{r['plain']['wall_s'] / h:.1f}×")
        cells.append(f"{r['keops']['wall_s'] / h:.1f}×" if r.get("keops") else "-")
        rows.append(cells)
    header = [f"kNN, k = {data['rows'][0]['k']}"] + [c for _, c in cols] + ["plain / hlopass", "KeOps / hlopass"]
    return _table(header, rows) + _source("knn_speed.json")


def bench_chunks() -> str:
    data = _load("chunks.json")
    variants = list(data["rows"][0]["variants"])
    rows = []
    for v in variants:
        cells = [v]
        for r in data["rows"]:
            c, d = r["variants"].get(v), r["variants"]["default"]
            if c is None:
                cells.append("-")
            elif v == "default":
                cells.append(f"{c['wall_s']:.3f} s, temp {_bytes(c['temp_bytes'])}")
            else:
                cells.append(f"{c['wall_s'] / d['wall_s']:.2f}×")
        rows.append(cells)
    return (_table(["choice (time relative to the default)"] + [r["program"] for r in data["rows"]], rows)
            + _source("chunks.json"))


def bench_never_worse() -> str:
    data = _load("never_worse.json")
    rows = []
    for name, r in data["rows"].items():
        kept = ", ".join(f"kept the {c['kept']} ({_bytes(c['original_bytes'])} original, "
                         f"{_bytes(c['rewritten_bytes'])} rewritten)" for c in r.get("comparisons", []))
        rows.append([f"`{name}`" + (f": {kept}" if kept else ""), _bytes(r.get("temp")),
                     _s(r.get("compile_s")), _s(r.get("run_s"))])
    return (_table([f"n = {data['n']:,}, float64, threshold {data['threshold']}", "XLA temp", "compile", "run"], rows)
            + _source("never_worse.json"))


def bench_sharded() -> str:
    data = _load("sharded.json")
    rows = []
    for r in data["rows"]:
        h, j = r["hlopass"], r["jit"]
        rows.append([r["program"], f"{r['n']:,} x {r['m']:,}",
                     f"{_bytes(h['temp'])} / {_bytes(j['temp'])} ({r['temp_ratio']:.3f}x)",
                     f"{h['run_s'] * 1e3:.0f} ms / {j['run_s'] * 1e3:.0f} ms ({r['time_ratio']:.2f}x)",
                     ", ".join(r["shardings"]), f"{r['relative_error']:.1e}"])
    return (_table(["program", "n x m", "per-device temp: hlopass / jax.jit", "run time: hlopass / jax.jit",
                    "output sharding", "max rel. error"], rows)
            + f"\n\n`{data['command']}`: {data['note']}." + _source("sharded.json"))


def _remat(name: str) -> str:
    data = _load(name)
    rows = []
    for r in data["rows"]:
        fits = "within" if r["fits"] else "**over**"
        rows.append([r["title"], r["column"], f"{_bytes(r['footprint_bytes'])} ({fits} {_bytes(r['limit_bytes'])})",
                     _s(r.get("compile_seconds")), _s(r.get("seconds")),
                     f"{r['ratio_to_plain']:.2f}×" if r.get("ratio_to_plain") is not None else "-",
                     f"{r['max_rel_diff']:.0e}" if r.get("max_rel_diff") is not None else "-"])
    return (_table(["program", "column", "XLA footprint (limit)", "compile", "best call", "vs plain",
                    "max rel. diff from plain"], rows)
            + f"\n\n`{data['meta']['command']}`" + _source(name))


def bench_remat() -> str:
    return _remat("remat.json")


def bench_remat_transformer() -> str:
    return _remat("remat_transformer.json") + "\n" + _remat("remat_transformer_nosplit.json")


def bench_online() -> str:
    return _load("online.json")["table"].strip() + _source("online.json")


def bench_online_decoding() -> str:
    return _load("online_decoding.json")["table"].strip() + _source("online_decoding.json")


def bench_attention() -> str:
    return _load("attention.json")["table"].strip() + _source("attention.json")


def bench_online_side_by_side() -> str:
    rows = [[r["row"], f"{r['hlopass_cpu_seconds']:.3g} s", f"{r['hand_cpu_seconds']:.3g} s",
             f"{r['hlopass_over_hand_cpu']:.2f}"] for r in _load("online_side_by_side.json")["side_by_side"]]
    return _table(["row", "hlopass CPU", "by hand CPU", "hlopass / hand"], rows) + _source("online_side_by_side.json")


def bench_scaling() -> str:
    data = _load("scaling.json")
    rows = []
    for r in data["rows"]:
        rows.append([r["mode"], f"{r['n']:,}", _bytes(r["dense_kernel_bytes"]), r["status"],
                     _bytes(r.get("xla_temp_bytes")), _bytes(r.get("peak_rss_bytes")), _s(r.get("run_seconds"))])
    a, r2 = data["fit"]

    def draw(fig):
        ax = fig.add_subplot(1, 1, 1)
        ok = [r for r in data["rows"] if r["mode"] == "hlopass" and r["status"] == "ok"]
        ns = [r["n"] for r in ok]
        ax.plot(ns, [r["run_seconds"] for r in ok], "o-", color="tab:orange", label="hlopass.jit")
        ax.plot(ns, [a * n * n for n in ns], "--", color="grey", label=f"{a:.2g}·n² (R² = {r2:.3f})")
        plain = [r for r in data["rows"] if r["mode"] == "plain" and r["status"] == "ok"]
        ax.plot([r["n"] for r in plain], [r["run_seconds"] for r in plain], "s", color="tab:blue",
                label="plain jax.jit (where it fits)")
        ax.set_xlabel("n")
        ax.set_ylabel("run time (s)")
        ax.set_title(f"kernel mat-vec under a {_bytes(data['cap_bytes'])} cap", fontsize=9)
        ax.legend(fontsize=8)

    return (_table(["mode", "n", "dense kernel", "status", "XLA temp", "peak RSS", "run"], rows) + "\n\n"
            + _plot("scaling", draw) + _source("scaling.json"))


def bench_sgpr_scale() -> str:
    rows = [[r["column"], r["status"], f"{r['n']:,}", r["m"], r["d"], _bytes(r.get("xla_temp_bytes")),
             _bytes(r.get("peak_rss_bytes")), _s(r.get("compile_seconds")), _s(r.get("run_seconds")),
             r.get("error", "")[:80]] for r in _load("sgpr_scale.json")]
    return (_table(["column", "status", "n", "m", "d", "XLA temp", "peak RSS", "compile", "run", "error"], rows)
            + _source("sgpr_scale.json"))


def bench_gpu() -> str:
    data = _load("gpu.json")
    rows = []
    for case in data["cases"]:
        plain = {r.get("quantity"): r for r in case.get("rows", []) if r["column"].startswith("plain")
                 and r["status"] == "ok"}
        for r in case.get("rows", []):
            base = plain.get(r.get("quantity"))
            ok = r["status"] == "ok"
            ratio = f"{base['median_s'] / r['median_s']:.2f}" if ok and base and base is not r else ""
            exact = ("" if "rows_wrong" not in r else f"{r['rows_wrong']} of {r['rows_checked']} rows wrong")
            rows.append([case["case"], case.get("device", ""), r["column"], r.get("quantity", ""),
                         _s(r.get("median_s")) if ok else "failed",
                         _bytes(r.get("temp_bytes")) if ok else r.get("error", "")[:60], ratio, exact])
        if "rows" not in case:
            rows.append([case["case"], case.get("device", ""), "", "", case.get("status", ""),
                         case.get("error", "")[:60], "", ""])
    return (f"{data['device']}, JAX {data['jax']}: {data['what']}\n\n"
            + _table(["case", "device", "column", "quantity", "call (median)", "XLA temp", "x plain", "neighbours"],
                     rows)
            + _source("gpu.json"))


# ---------------------------------------------------------------- a real dump

_DUMP: dict[str, str] = {}


def _dump() -> dict[str, str]:
    """Run hlopass-dump once per build on the kernel mat-vec; return its report text."""
    if not _DUMP:
        with tempfile.TemporaryDirectory() as out:
            command = [sys.executable, "-m", "hlopass.inspection.cli", "fixtures/kernels.py:kernel_matvec",
                       "--arg", "f32[5000,3]", "--arg", "f32[5000,3]", "--arg", "f32[5000]",
                       "--threshold", "10MB", "--split-size", "4MB", "--out", out, "--format", "svg"]
            done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
            if done.returncode != 0:
                raise RuntimeError(f"hlopass-dump failed:\n{done.stdout}\n{done.stderr}")
            for name in ("graph_before.svg", "graph_after.svg", "memory.svg"):
                with open(os.path.join(out, name), "rb") as handle:
                    _ASSETS[f"generated/dump/{name}"] = handle.read()
            with open(os.path.join(out, "report.txt")) as handle:
                _DUMP["report"] = handle.read()
            _DUMP["files"] = ", ".join(f"`{n}`" for n in sorted(os.listdir(out)))
    return _DUMP


def dump_report() -> str:
    dump = _dump()
    return f"```text\n{dump['report'].rstrip()}\n```\n\nThe folder holds {dump['files']}."


def dump_pictures() -> str:
    _dump()
    return "\n\n".join(f"![{name}](@ROOT@generated/dump/{name}.svg)" for name in ("graph_before", "graph_after", "memory"))


GENERATORS = {name: fn for name, fn in globals().items()
              if callable(fn) and (name.startswith("bench_") or name.startswith("dump_") or name == "architecture")}


# ---------------------------------------------------------------- MkDocs events

_TEXT: dict[str, str] = {}


def on_files(files, config):
    """Run every generator the pages ask for (plots and the dump need to exist before links are checked)."""
    from mkdocs.structure.files import File
    _TEXT.clear()
    _ASSETS.clear()
    _DUMP.clear()
    for file in files.documentation_pages():
        for name in MARKER.findall(file.content_string):
            if name not in GENERATORS:
                raise KeyError(f"{file.src_path}: unknown generated block {name!r}; known: {sorted(GENERATORS)}")
            if name not in _TEXT:
                _TEXT[name] = GENERATORS[name]()
    for path, content in _ASSETS.items():
        files.append(File.generated(config, path, content=content))
    return files


def on_page_markdown(markdown, page, config, files):
    folder = os.path.dirname(page.file.src_uri)
    root = "../" * (folder.count("/") + 1) if folder else ""
    return MARKER.sub(lambda match: _TEXT[match.group(1)].replace("@ROOT@", root), markdown)
