"""Bad configuration, as a table: every setting x every bad form, as a keyword (rejected when
``hlopass.jit`` is applied) and as an environment variable (rejected when the function is called):
a ``ConfigError`` naming the setting, the value and the accepted forms, never an internal error.
Also unknown keywords and unknown ``HLOPASS_*`` variables. (The CLI's table is in
``tests/inspection/test_dump.py``.)"""

import os
import warnings

import jax.numpy as jnp
import pytest

import hlopass
from hlopass import settings
from hlopass.errors import ConfigError, ConfigWarning

SIZE_BAD = ["0", 0, "0.5", 0.5, "0 kB", "-1", -3, "lots", "1e3", "10 M B", "1,000", True, [1], b"1MB",
            float("nan"), {}]
BAD = {
    "threshold": SIZE_BAD,
    "split_size": SIZE_BAD + ["2GB"],  # larger than the (1 GB) threshold below
    "memory_limit": SIZE_BAD,
    "passes": ["warp", "split,warp", "-warp", 3, [1], b"split", [None]],
    "dump_to": [b"dumps", 123, True, 1.5, "<existing file>", "<under existing file>"],
    "strict": ["maybe", 2, 1.5, [], "yes please", "tru"],
    "min_gain": ["0.5", 0, -1, "fast", True, float("inf"), float("nan"), "1.0x", [2]],
    "never_worse": ["sometimes", 3, 0.5, [True]],
}
ROWS = [(key, value) for key, values in BAD.items() for value in values]


def _materialise(value, tmp_path):
    if value == "<existing file>":
        path = tmp_path / "a_file"
        path.write_text("x")
        return str(path)
    if value == "<under existing file>":
        path = tmp_path / "b_file"
        path.write_text("x")
        return str(path / "dumps")
    return value


def _context(key):
    # split_size is judged against a threshold given alongside it
    return {"threshold": "1GB"} if key == "split_size" else {}


def _check_message(message, setting):
    assert setting in message, message
    assert "accepted" in message, message
    assert "==" not in message and "<object object" not in message, message


@pytest.mark.parametrize("key, value", ROWS, ids=[f"{k}={v!r}" for k, v in ROWS])
def test_bad_keyword_rejected_when_applied(key, value, tmp_path):
    value = _materialise(value, tmp_path)
    with pytest.raises(ConfigError) as err:
        hlopass.jit(lambda x: x, **{key: value}, **_context(key))
    _check_message(str(err.value), f"{key}=")
    with pytest.raises(ConfigError):
        hlopass.jit(**{key: value}, **_context(key))  # the decorator form checks before it has a function


ENV_ROWS = [(key, value) for key, value in ROWS if isinstance(value, str)]


@pytest.mark.parametrize("key, value", ENV_ROWS, ids=[f"{settings.SETTINGS[k]}={v!r}" for k, v in ENV_ROWS])
def test_bad_environment_value_rejected_when_called(key, value, tmp_path, monkeypatch):
    value = _materialise(value, tmp_path)
    name = settings.SETTINGS[key]
    monkeypatch.setenv(name, value)
    if key == "split_size":
        monkeypatch.setenv(settings.ENV_THRESHOLD, "1GB")
    h = hlopass.jit(lambda x: x + 1)  # decoration reads no environment
    with pytest.raises(ConfigError) as err:
        h(jnp.ones(2))
    _check_message(str(err.value), name)


@pytest.mark.parametrize("spelling", ["0", "0.5", "0 B", "0.0001kB"])
def test_zero_threshold_names_the_threshold(spelling, monkeypatch):
    monkeypatch.setenv(settings.ENV_THRESHOLD, spelling)
    with pytest.raises(ConfigError) as err:
        settings.resolve()
    assert str(err.value).startswith(f"{settings.ENV_THRESHOLD}={spelling!r}")
    with pytest.raises(ConfigError) as err:
        hlopass.jit(lambda x: x, threshold=spelling)
    assert str(err.value).startswith(f"threshold={spelling!r}")


def test_misspelled_keyword_rejected_when_applied():
    with pytest.raises(ConfigError) as err:
        hlopass.jit(lambda x: x, threshhold="1MB")
    message = str(err.value)
    assert "threshhold" in message and "threshold" in message and "static_argnums" in message
    with pytest.raises(ConfigError):
        hlopass.jit(threshhold="1MB")


def test_environment_read_at_call_not_at_decoration(monkeypatch):
    monkeypatch.setenv(settings.ENV_MEMORY_LIMIT, "lots")
    h = hlopass.jit(lambda x: x * 2)
    monkeypatch.setenv(settings.ENV_MEMORY_LIMIT, "1GB")
    assert float(h(jnp.ones(2)).sum()) == 4.0


def test_unknown_variable_warned_once_naming_the_known_ones(monkeypatch):
    name = "HLOPASS_TENSOR_SIZE_TRESHOLD_FOR_TEST"
    monkeypatch.setenv(name, "1MB")
    with pytest.warns(ConfigWarning) as record:
        settings.resolve()
    message = str(record[0].message)
    assert name in message and settings.ENV_THRESHOLD in message and "HLOPASS_PASSES" in message
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        settings.resolve()  # once


def test_known_other_variables_are_not_warned_about(monkeypatch):
    for name in settings.OTHER_VARIABLES:
        monkeypatch.setenv(name, os.environ.get(name, "text" if name == settings.ENV_DUMP_FORMAT else "0"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        settings.resolve()


def test_bad_dump_format(monkeypatch):
    monkeypatch.setenv(settings.ENV_DUMP_FORMAT, "gif")
    with pytest.raises(ConfigError, match="HLOPASS_DUMP_FORMAT='gif'.*accepted forms: text, svg, png"):
        settings.resolve()


def test_good_forms_still_accepted(tmp_path):
    h = hlopass.jit(lambda x: x, threshold="1 B", split_size=1, memory_limit="off", passes=["split"],
                    dump_to=tmp_path / "new" / "folder", strict="yes", min_gain="1")
    config = h.config()
    assert (config.threshold, config.split_size, config.memory_limit, config.strict) == (1, 1, None, True)
    assert config.dump_to == str(tmp_path / "new" / "folder") and config.min_gain == 1.0
