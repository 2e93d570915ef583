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


# -- misuse and failures: one error line, never a traceback from inside hlopass --------------------

MISUSE = [
    ([":good", "--arg", "f32[3]"], "must be FILE_OR_MODULE:FUNCTION"),
    (["{t}:", "--arg", "f32[3]"], "must be FILE_OR_MODULE:FUNCTION"),
    (["{t}:plain_square", "--arg", "f32[3,,3]"], "is not an argument spec"),
    (["{t}:plain_square", "--arg", "f32[3,]"], "is not an argument spec"),
    (["{t}:plain_square", "--arg", "f32[3]", "--threshold", "0"], "threshold='0'"),
    (["{t}:plain_square", "--arg", "f32[3]", "--threshold", "0.5"], "threshold='0.5'"),
    (["{t}:plain_square", "--arg", "f32[3]", "--split-size", "0"], "split_size='0'"),
    (["{t}:plain_square", "--arg", "f32[3]", "--memory-limit", "lots"], "memory_limit='lots'"),
    (["{t}:plain_square", "--arg", "f32[3]", "--passes", "warp"], "unknown pass 'warp'"),
    (["{t}:plain_square", "--arg", "f32[3]", "--out", "{file}"], "--out="),
    (["{t}:plain_square", "--arg", "f32[3]", "--out", "{file}/sub"], "--out="),
    (["{t}:plain_square", "--arg", "f32[3]", "--arg", "f32[3]"], "calling"),
]


@pytest.mark.parametrize("argv, message", MISUSE, ids=[" ".join(a) for a, _ in MISUSE])
def test_cli_misuse_is_one_error_line(argv, message, tmp_path, capsys):
    a_file = tmp_path / "a_file.txt"
    a_file.write_text("not a folder")
    status = main([a.format(t=TARGET, file=a_file) for a in argv])
    err = capsys.readouterr().err
    assert status == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("hlopass-dump: error:") and message in lines[0], err


def test_cli_bad_environment_is_one_error_line(monkeypatch, capsys):
    monkeypatch.setenv("HLOPASS_MEMORY_LIMIT", "lots")
    assert main([f"{TARGET}:plain_square", "--arg", "f32[3]"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hlopass-dump: error: HLOPASS_MEMORY_LIMIT='lots'") and len(err.splitlines()) == 1


@pytest.mark.parametrize("function, error", [("raises_value_error", "ValueError"), ("raises_key_error", "KeyError")])
def test_cli_user_exception_shows_the_users_frames_only(function, error, capsys):
    status = main([f"{TARGET}:{function}", "--arg", "f32[5]"])
    err = capsys.readouterr().err
    assert status == 1
    assert f"raised {error}" in err and "dump_target.py" in err
    assert f"{os.sep}hlopass{os.sep}" not in err and "site-packages" not in err, err
    assert err.splitlines()[-1].startswith("hlopass-dump: error:")


def test_cli_strict_over_the_limit_exits_nonzero(monkeypatch, capsys):
    monkeypatch.setenv("HLOPASS_STRICT", "1")
    status = main([f"{TARGET}:plain_square", "--arg", "f32[1000]", "--memory-limit", "1kB", "--passes", "none"])
    captured = capsys.readouterr()
    assert status == 1
    assert "over the memory limit" in captured.err and "hlopass-dump: error:" in captured.err
    assert "hlopass report for plain_square" in captured.out


def test_cli_errors_never_print_a_traceback_subprocess(tmp_path):
    """The console script as users run it: the misuse, the user's error and a file for --out."""
    a_file = tmp_path / "f"
    a_file.write_text("x")
    for argv, code in ([":good"], 2), ([f"{TARGET}:raises_value_error", "--arg", "f32[5]"], 1), \
            ([f"{TARGET}:plain_square", "--arg", "f32[3]", "--out", str(a_file)], 2):
        result = run_cli(*argv)
        assert result.returncode == code, result.stderr
        assert "Traceback (most recent call last)" not in result.stderr, result.stderr
        assert f"{os.sep}hlopass{os.sep}" not in result.stderr, result.stderr


def test_dump_to_unusable_folder_is_a_config_error(tmp_path, monkeypatch):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    for folder in (a_file, a_file / "under"):
        monkeypatch.setenv("HLOPASS_DUMP_TO", str(folder))
        with pytest.raises(hlopass.ConfigError, match="HLOPASS_DUMP_TO="):
            hlopass.jit(lambda x: x + 1)(jnp.ones(3))
        with pytest.raises(hlopass.ConfigError, match="dump_to="):
            hlopass.jit(lambda x: x + 1, dump_to=folder)


def test_failing_dump_warns_and_the_call_goes_on(tmp_path, monkeypatch, caplog):
    from hlopass import api

    def broken(*args):
        raise OSError("disk full")

    monkeypatch.setattr(api, "compile_listeners", [broken])
    h = hlopass.jit(lambda x: jnp.exp(x) @ x.T, dump_to=tmp_path)
    with caplog.at_level("WARNING", logger="hlopass"):
        out = h(jnp.ones((3, 2)))
    assert out.shape == (3, 3)
    assert "disk full" in caplog.text


def test_failing_picture_warns_and_the_call_goes_on(tmp_path, monkeypatch, caplog):
    import hlopass.inspection.draw as draw

    def broken(*args, **kwargs):
        raise RuntimeError("no renderer")

    monkeypatch.setattr(draw, "draw_explanation", broken)
    monkeypatch.setenv("HLOPASS_DUMP_FORMAT", "svg")
    monkeypatch.setenv("HLOPASS_DUMP_TO", str(tmp_path))
    with caplog.at_level("WARNING", logger="hlopass"):
        out = hlopass.jit(lambda x: x * 3)(jnp.ones(4))
    assert float(out.sum()) == 12.0 and "no renderer" in caplog.text


def test_cli_progress_bar(capsys):
    argv = [f"{TARGET}:kernel_matvec", "--arg", "f32[500,3]", "--arg", "f32[400,3]", "--arg", "f32[400]",
            "--threshold", "100kB", "--no-compile"]
    assert main([*argv, "--progress", "on"]) == 0
    err = capsys.readouterr().err
    assert "hlopass-dump: kernel_matvec: passes [" in err and "\r" in err
    assert "split (" in err and "6/6 done in" in err  # the pass running, then the end
    assert main([*argv, "--progress", "off"]) == 0
    assert "passes [" not in capsys.readouterr().err
    assert main(argv) == 0  # auto: stderr is not a terminal here
    assert "passes [" not in capsys.readouterr().err
