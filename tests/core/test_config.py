"""Configuration: size spellings, environment vs keywords, and errors that name the setting."""

import pytest

import hlopass
from hlopass import config as config_mod
from hlopass import settings
from hlopass.errors import ConfigError
from hlopass.sizes import format_size, parse_size


@pytest.mark.parametrize("text, expected", [
    ("0", 0), ("1000", 1000), ("1000B", 1000), ("12 b", 12),
    ("1kB", 1000), ("1KB", 1000), ("2 mb", 2_000_000), ("1GB", 10**9), ("1.5GB", 1_500_000_000),
    ("3TB", 3 * 10**12), (".5MB", 500_000), ("2.MB", 2_000_000),
    ("1KiB", 1024), ("1kib", 1024), ("4 MiB", 4 * 2**20), ("1GiB", 2**30), ("1.5 GiB", int(1.5 * 2**30)),
    ("2TiB", 2 * 2**40), ("  100MB  ", 10**8),
])
def test_size_spellings(text, expected):
    assert parse_size(text, "X") == expected


def test_gib_is_two_to_the_thirty():
    # eXLA multiplied GiB by 2**27; ours must not.
    assert parse_size("1GiB", "X") == 1073741824


@pytest.mark.parametrize("text", ["", "abc", "10 parsecs", "1.2.3GB", "GB", "1e3", "10 M B", "1,000"])
def test_unparseable_sizes_name_the_setting(text):
    with pytest.raises(ConfigError) as err:
        parse_size(text, "HLOPASS_TENSOR_SIZE_THRESHOLD")
    message = str(err.value)
    assert "HLOPASS_TENSOR_SIZE_THRESHOLD" in message and repr(text) in message and "KiB" in message


@pytest.mark.parametrize("value", ["-1", "-5MB", -3])
def test_negative_sizes_rejected(value):
    with pytest.raises(ConfigError, match="negative"):
        parse_size(value, "threshold=")


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)


@pytest.mark.parametrize("text", ["off", "OFF", "none", "inf", "never"])
def test_off_spellings(text):
    assert parse_size(text, "X", allow_off=True) is None
    with pytest.raises(ConfigError):
        parse_size(text, "X")


def test_numbers_accepted_as_bytes():
    assert parse_size(1234, "X") == 1234
    assert parse_size(1.5e6, "X") == 1_500_000


def test_format_size():
    assert format_size(1.5e9) == "1.50 GB"
    assert format_size(999) == "999 B"
    assert format_size(None) == "off"


def test_environment_read(monkeypatch):
    monkeypatch.setenv("HLOPASS_TENSOR_SIZE_THRESHOLD", "1GB")
    monkeypatch.setenv("HLOPASS_TENSOR_SPLIT_SIZE", "500MB")
    monkeypatch.setenv("HLOPASS_MEMORY_LIMIT", "8GiB")
    monkeypatch.setenv("HLOPASS_PASSES", "none")
    monkeypatch.setenv("HLOPASS_DUMP_TO", "/tmp/somewhere")
    monkeypatch.setenv("HLOPASS_STRICT", "1")
    cfg = settings.resolve()
    assert (cfg.threshold, cfg.split_size, cfg.memory_limit) == (10**9, 5 * 10**8, 8 * 2**30)
    assert cfg.passes == () and cfg.dump_to == "/tmp/somewhere" and cfg.strict


def test_keywords_override_environment(monkeypatch):
    monkeypatch.setenv("HLOPASS_TENSOR_SIZE_THRESHOLD", "1GB")
    cfg = settings.resolve({"threshold": "10MB", "split_size": 1000})
    assert cfg.threshold == 10**7 and cfg.split_size == 1000


def test_split_size_defaults_to_threshold():
    cfg = settings.resolve({"threshold": "3MB"})
    assert cfg.split_size == 3 * 10**6


def test_split_larger_than_threshold_is_an_error(monkeypatch):
    monkeypatch.setenv("HLOPASS_TENSOR_SIZE_THRESHOLD", "100MB")
    monkeypatch.setenv("HLOPASS_TENSOR_SPLIT_SIZE", "200MB")
    with pytest.raises(ConfigError, match="HLOPASS_TENSOR_SPLIT_SIZE.*larger than the threshold"):
        settings.resolve()


def test_threshold_off_turns_splitting_off(monkeypatch):
    monkeypatch.setenv("HLOPASS_TENSOR_SIZE_THRESHOLD", "off")
    cfg = settings.resolve()
    assert cfg.threshold is None and cfg.split_size is None


def test_defaults_protect_without_settings():
    cfg = settings.resolve()
    memory = config_mod.device_memory_bytes()
    assert cfg.memory_limit == memory
    assert cfg.threshold == config_mod.default_threshold(memory)
    assert config_mod.DEFAULT_THRESHOLD_MIN <= cfg.threshold <= config_mod.DEFAULT_THRESHOLD_MAX
    assert cfg.split_size == cfg.threshold
    assert cfg.pass_names == hlopass.registry.default_pipeline()


def test_default_threshold_scales_with_memory():
    assert config_mod.default_threshold(4 * 10**9) == 2 * 10**8
    assert config_mod.default_threshold(10**12) == 2**30
    assert config_mod.default_threshold(10**3) == 2**20


def test_bad_environment_value_names_the_variable(monkeypatch):
    monkeypatch.setenv("HLOPASS_MEMORY_LIMIT", "lots")
    with pytest.raises(ConfigError, match="HLOPASS_MEMORY_LIMIT='lots'"):
        settings.resolve()


def test_bad_keyword_fails_at_decoration():
    with pytest.raises(ConfigError, match="threshold="):
        hlopass.jit(lambda x: x, threshold="ten megabytes")


def test_unknown_pass_lists_available(monkeypatch):
    monkeypatch.setenv("HLOPASS_PASSES", "split,teleport")
    with pytest.raises(ConfigError) as err:
        settings.resolve()
    assert "teleport" in str(err.value) and "HLOPASS_PASSES" in str(err.value) and "available passes" in str(err.value)


def test_pass_list_forms():
    from hlopass.registry import default_pipeline, register_pass, resolve_pass_names

    @register_pass
    class Dummy(hlopass.Pass):
        name = "test_dummy"

        def run_level(self, closed, config, report):
            return closed

    assert resolve_pass_names("none") == ()
    assert resolve_pass_names("") == ()
    assert resolve_pass_names(None) == default_pipeline()
    assert resolve_pass_names("default") == default_pipeline()
    assert resolve_pass_names("test_dummy") == ("test_dummy",)
    assert resolve_pass_names(["test_dummy"]) == ("test_dummy",)
    assert resolve_pass_names("default,test_dummy") == (*default_pipeline(), "test_dummy")
    assert resolve_pass_names("test_dummy,-test_dummy") == ()
    assert resolve_pass_names("-test_dummy") == default_pipeline()
    for name in default_pipeline():
        assert name not in resolve_pass_names(f"-{name}")


def test_bad_boolean(monkeypatch):
    monkeypatch.setenv("HLOPASS_STRICT", "maybe")
    with pytest.raises(ConfigError, match="HLOPASS_STRICT"):
        settings.resolve()


def test_unknown_keyword_setting():
    with pytest.raises(ConfigError, match="unknown hlopass setting"):
        settings.resolve({"treshold": "1MB"})
