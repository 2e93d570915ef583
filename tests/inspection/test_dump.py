"""``hlopass-dump``, ``hlopass.explain`` and ``HLOPASS_DUMP_TO``."""

import json
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

import hlopass
from hlopass.inspection.cli import main, parse_arg_spec

HERE = os.path.dirname(__file__)
TARGET = os.path.join(HERE, "dump_target.py")


def run_cli(*argv):
    return subprocess.run([sys.executable, "-m", "hlopass.inspection.cli", *argv], capture_output=True, text=True,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"}, timeout=300)


@pytest.mark.parametrize("spec, shape, dtype", [
    ("f32[1000,3]", (1000, 3), jnp.float32), ("bf16[2]", (2,), jnp.bfloat16), ("f16[4,4]", (4, 4), jnp.float16),
    ("i32[]", (), jnp.int32), ("bool[3, 5]", (3, 5), jnp.bool_), ("F32[7]", (7,), jnp.float32),
])
def test_arg_specs(spec, shape, dtype):
    parsed = parse_arg_spec(spec)
    assert parsed.shape == shape and parsed.dtype == dtype


def test_cli_end_to_end(tmp_path):
    out = tmp_path / "dump"
    result = run_cli(f"{TARGET}:kernel_matvec", "--arg", "f32[300,3]", "--arg", "f32[300,3]", "--arg", "f32[300,1]",
                     "--threshold", "100kB", "--out", str(out))
    assert result.returncode == 0, result.stderr
    for name in ("original.jaxpr.txt", "rewritten.jaxpr.txt", "before.stablehlo.mlir", "after.stablehlo.mlir",
                 "report.txt", "report.json"):
        assert (out / name).stat().st_size > 0, name
    assert "hlopass report for kernel_matvec" in result.stdout and "XLA memory before" in result.stdout
    report = json.loads((out / "report.json").read_text())
    assert report["label"] == "kernel_matvec" and report["memory_before"]["temp_bytes"] > 0
    assert "threshold=100.00 kB" in report["config"]
    assert "stablehlo" in (out / "after.stablehlo.mlir").read_text()


def test_cli_plain_function_in_module(capsys):
    sys.path.insert(0, HERE)
    try:
        assert main(["dump_target:plain_square", "--arg", "f32[8]", "--passes", "none", "--no-compile"]) == 0
    finally:
        sys.path.remove(HERE)
    assert "plain_square" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["{t}:kernel_matvec", "--arg", "f32[10,x]"], "is not an argument spec"),
    (["{t}:kernel_matvec", "--arg", "q8[10]"], "is not an argument spec"),
    (["{t}:no_such_function", "--arg", "f32[3]"], "has no function 'no_such_function'"),
    (["missing_file.py:f", "--arg", "f32[3]"], "does not exist"),
    (["no_colon_here"], "must be FILE_OR_MODULE:FUNCTION"),
    (["{t}:kernel_matvec", "--arg", "f32[10,3]", "--threshold", "lots"], "--threshold=" if False else "threshold="),
    (["{t}:kernel_matvec", "--arg", "f32[10,3]"], "calling"),
    (["{t}:kernel_matvec", "--arg", "f32[3]", "--passes", "warp"], "unknown pass 'warp'"),
])
def test_cli_errors_are_clear(argv, message):
    result = run_cli(*[a.format(t=TARGET) for a in argv])
    assert result.returncode == 2
    assert message in result.stderr and "Traceback" not in result.stderr, result.stderr


def test_console_script_installed():
    script = shutil.which("hlopass-dump", path=os.path.dirname(sys.executable))
    assert script is not None
    result = subprocess.run([script, "--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "FILE.py:FUNCTION" in result.stdout


def test_explain_api():
    x = jax.ShapeDtypeStruct((64, 3), jnp.float32)
    v = jax.ShapeDtypeStruct((64, 1), jnp.float32)
    sys.path.insert(0, HERE)
    try:
        import dump_target
    finally:
        sys.path.remove(HERE)
    explanation = hlopass.explain(dump_target.kernel_matvec, x, x, v)
    assert explanation.memory_before.temp_bytes > 0
    assert "reduce_sum" in str(explanation.original_jaxpr)
    assert "func.func" in explanation.stablehlo_after
    assert "hlopass report for kernel_matvec" in str(explanation)
    assert explanation.to_dict()["memory_after"]["limit"] == explanation.config.memory_limit


def test_dump_to_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("HLOPASS_DUMP_TO", str(tmp_path))
    h = hlopass.jit(lambda x: jnp.exp(x) @ x.T)
    h(jnp.ones((5, 4)))
    folders = os.listdir(tmp_path)
    assert len(folders) == 1 and folders[0].endswith("_lambda")
    assert "exp" in (tmp_path / folders[0] / "original.jaxpr.txt").read_text()
    h(jnp.ones((5, 4)))  # same signature: compiled once, dumped once
    assert len(os.listdir(tmp_path)) == 1
