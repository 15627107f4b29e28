import pytest

from zbroker.storage.log import LogConfig


def test_defaults_round_trip_through_a_dict():
    config = LogConfig()
    assert config.segment_bytes == 64 * 1024 * 1024
    assert config.retention_bytes == -1
    assert LogConfig.from_dict(config.to_dict()) == config


def test_from_dict_takes_known_keys_and_ignores_the_rest():
    config = LogConfig.from_dict({"segment_bytes": 1024, "retention_ms": -1, "compression": "zstd"})
    assert config.segment_bytes == 1024
    assert config.retention_ms == -1
    assert config.index_interval_bytes == LogConfig().index_interval_bytes


def test_from_dict_none_means_defaults():
    assert LogConfig.from_dict(None) == LogConfig()


@pytest.mark.parametrize("bad", [
    {"segment_bytes": 0},
    {"segment_bytes": 2 ** 32},
    {"segment_bytes": "1024"},
    {"segment_bytes": True},
    {"index_interval_bytes": 0},
    {"retention_bytes": -2},
    {"retention_ms": -5},
    {"producer_window_segments": 0},
    {"retention_ms": 1.5},
])
def test_bad_values_are_rejected(bad):
    with pytest.raises(ValueError):
        LogConfig.from_dict(bad)


def test_a_non_map_is_rejected():
    with pytest.raises(ValueError):
        LogConfig.from_dict([("segment_bytes", 1024)])  # type: ignore[arg-type]
