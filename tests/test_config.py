import pytest

from flatcake_ray.config import PlacementConfig, StoreConfig, parse_size
from flatcake_ray.errors import ConfigError


def test_sizes():
    assert parse_size("64KiB") == 65536
    assert parse_size("4G") == 4 << 30
    assert parse_size("1.5m") == 3 << 19
    assert parse_size(4096) == 4096
    with pytest.raises(ConfigError):
        parse_size("lots")


def test_env_overrides_arguments():
    environ = {
        "FLATCAKE_DRAM_BYTES": "8MiB",
        "FLATCAKE_SSD_DIRS": "/a:/b",
        "FLATCAKE_FSYNC": "no",
        "FLATCAKE_HIGH_WATERMARK": "0.95",
        "FLATCAKE_TAU_TOKENS": "2048",
    }
    config = StoreConfig.from_env(environ, root="/r", layers=2, page_bytes=4096, dram_bytes=4096)
    assert config.dram_bytes == 8 << 20
    assert config.ssd_dirs == ("/a", "/b") and config.ssd_folders == ("/a", "/b")
    assert config.fsync is False and config.high_watermark == 0.95
    assert config.placement == PlacementConfig(tau_tokens=2048)


def test_bad_env_value_names_the_variable():
    with pytest.raises(ConfigError, match="FLATCAKE_LAYERS"):
        StoreConfig.from_env({"FLATCAKE_LAYERS": "many"}, root="/r", layers=2, page_bytes=4096)


@pytest.mark.parametrize(
    "overrides",
    [
        {"layers": 0},
        {"page_bytes": -1},
        {"node_id": 4096},
        {"dram_bytes": 1000},
        {"ssd_file_bytes": 4097},
        {"low_watermark": 0.95, "high_watermark": 0.9},
        {"ssd_low_watermark": 0.95, "ssd_high_watermark": 0.9},
        {"ssd_high_watermark": 1.5},
        {"hugepages": "sometimes"},
        {"max_read_bytes": 100},
    ],
)
def test_invalid_values_are_value_errors(overrides):
    base = {"root": "/r", "layers": 2, "page_bytes": 4096}
    with pytest.raises(ValueError):
        StoreConfig(**{**base, **overrides})
