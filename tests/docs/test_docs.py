"""The documentation: a strict MkDocs build, and every ```python block of docs/ and the README runs.

A block that must not run says so on its first line, with a reason:

    # docs-test: skip (needs a GPU)

Blocks that are not Python for a reader to run (shell commands, output) use another fence language
(```bash, ```text).
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SKIP = re.compile(r"^# docs-test: skip \((.+)\)$")
FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
TIMEOUT_S = 120


def _markdown_files() -> list[str]:
    files = sorted(glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True))
    return [os.path.join(ROOT, "README.md"), *files]


def _python_blocks() -> list[tuple[str, str]]:
    blocks = []
    for path in _markdown_files():
        with open(path) as handle:
            text = handle.read()
        for match in FENCE.finditer(text):
            line = text[:match.start()].count("\n") + 1
            blocks.append((f"{os.path.relpath(path, ROOT)}:{line}", match.group(1)))
    return blocks


BLOCKS = _python_blocks()


def test_docs_have_python_examples():
    assert len(BLOCKS) >= 5, [where for where, _ in BLOCKS]


@pytest.mark.parametrize("code", [code for _, code in BLOCKS], ids=[where for where, _ in BLOCKS])
def test_python_block_runs(code, tmp_path):
    first = code.splitlines()[0] if code.strip() else ""
    skipped = SKIP.match(first)
    if skipped:
        pytest.skip(skipped.group(1))
    assert first.startswith("# docs-test") is False, f"malformed marker (write '# docs-test: skip (reason)'): {first}"
    assert "print(" in code or "assert " in code, "an example that runs must print or assert something"
    script = tmp_path / "example.py"
    script.write_text(code)
    env = {**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
    env.pop("XLA_FLAGS", None)  # a block sets its own (the sharding example asks for 4 host devices)
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=TIMEOUT_S)
    assert done.returncode == 0, f"stdout:\n{done.stdout[-4000:]}\nstderr:\n{done.stderr[-4000:]}"
    assert "print(" not in code or done.stdout.strip(), "the example prints nothing"


def test_mkdocs_build_is_strict_and_clean(tmp_path):
    pytest.importorskip("mkdocs", reason="the docs extra (bash tools/setup.sh docs) is not installed")
    site = tmp_path / "site"
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-6000:]
    for page in ("index.html", "passes/split/index.html", "benchmarks/index.html", "architecture/index.html"):
        assert (site / page).exists(), page
    # the pass pages carry the pass's docstring (mkdocstrings), not a hand copy
    for name in ("split", "algebraic", "matrix_chain", "hvp", "remat"):
        html = (site / "passes" / name / "index.html").read_text()
        for section in ("Matches", "Emits", "Leaves alone"):
            assert section in html, (name, section)
    # generated at build time: the layers diagram, the plots and the example dump's pictures
    assert 'class="mermaid"' in (site / "architecture" / "index.html").read_text()
    for asset in ("generated/bench_suite.png", "generated/scaling.png", "generated/dump/graph_after.svg",
                  "generated/dump/memory.svg"):
        assert (site / asset).stat().st_size > 1000, asset
    shutil.rmtree(site)


def test_readme_is_short_and_keeps_the_two_commands():
    with open(os.path.join(ROOT, "README.md")) as handle:
        text = handle.read()
    assert text.count("\n") <= 200
    assert "| set up and run the main job (a demonstration on a built-in example) | `bash tools/demo.sh` |" in text
    assert "| set up and run the tests | `bash tools/test.sh` |" in text
    assert "`.ci/run` calls `bash tools/test.sh`" in text
    for link in re.findall(r"\]\((docs/[^)#]*)", text):
        assert os.path.exists(os.path.join(ROOT, link)), link
