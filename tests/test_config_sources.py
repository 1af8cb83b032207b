"""Typed configuration from every source: constructor arguments, a JSON/TOML file,
``FLATCAKE_*`` variables, command-line flags. A wrong value is a ConfigError naming the
field and its source, whatever it is; never another exception, never a silent guess."""

import argparse
import json
import math

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from flatcake_ray.cli.service import add_service_commands, config_from_args
from flatcake_ray.config import PlacementConfig, ServiceConfig, StoreConfig
from flatcake_ray.config_sources import Source, build_config, field_kinds, parse_size
from flatcake_ray.errors import ConfigError

STORE_BASE = {"root": "/r", "layers": 2, "page_bytes": 4096}
SERVICE_FIELDS = sorted(field_kinds(ServiceConfig))
STORE_FIELDS = sorted(field_kinds(StoreConfig))
NODE = "abcdef0123456789"
TYPES = {"int": int, "size": int, "float": float, "bool": bool, "str": str, "paths": tuple}


def start_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_service_commands(parser.add_subparsers(dest="command"))
    return parser.parse_args(["start", *argv])


def assert_well_typed(config) -> None:
    """Every field holds its declared type (bools are not ints)."""
    for name, kind in field_kinds(type(config)).items():
        value = getattr(config, name)
        if isinstance(kind, type):
            assert isinstance(value, kind)
            assert_well_typed(value)
        else:
            assert type(value) is TYPES[kind], (name, value)
            if kind == "paths":
                assert all(type(v) is str and v for v in value)


# ---- the reported defects --------------------------------------------------------------------
def test_a_string_where_a_list_belongs_is_an_error_not_one_folder_per_character(tmp_path):
    path = tmp_path / "service.json"
    path.write_text(json.dumps({"ssd_dirs": "/path"}))
    with pytest.raises(ConfigError, match=r"ssd_dirs.*list of folders") as caught:
        config_from_args(start_args("--config", str(path)))
    assert str(path) in str(caught.value)
    with pytest.raises(ConfigError, match="ssd_dirs"):
        ServiceConfig(ssd_dirs="/path")
    with pytest.raises(ConfigError, match="ssd_dirs"):
        StoreConfig(**STORE_BASE, ssd_dirs="/path")


@pytest.mark.parametrize(
    "source",
    [
        lambda: StoreConfig(**{**STORE_BASE, "page_bytes": 2.5}),
        lambda: ServiceConfig(page_bytes=2.5),
        lambda: ServiceConfig.from_env({"FLATCAKE_PAGE_BYTES": "2.5"}),
        lambda: config_from_args(start_args("--page-bytes", "2.5")),
    ],
    ids=["store-arguments", "service-arguments", "environment", "flag"],
)
def test_a_fractional_page_size_is_an_error(source):
    with pytest.raises(ConfigError, match=r"page_bytes|PAGE_BYTES|page-bytes"):
        source()


def test_nonsense_counts_fail_validation():
    with pytest.raises(ConfigError, match="ssd_files_per_dir"):
        StoreConfig(**STORE_BASE, ssd_files_per_dir=0)
    with pytest.raises(ConfigError, match="ssd_files_per_dir"):
        ServiceConfig(ssd_files_per_dir=0)
    with pytest.raises(ConfigError, match="must fit one SSD pool file"):
        StoreConfig(**{**STORE_BASE, "layers": 300, "ssd_file_bytes": 1 << 20})
    with pytest.raises(ConfigError, match="lease_ttl_s"):
        ServiceConfig(lease_ttl_s=math.inf)
    with pytest.raises(ConfigError, match="twice"):
        StoreConfig(**STORE_BASE, ssd_dirs=("/a", "/a"))


@pytest.mark.parametrize(
    "given",
    [{"layers": True}, {"fsync": 1}, {"page_bytes": True}, {"ramp_floor": True}],
)
def test_bools_are_not_ints_and_ints_are_not_bools(given):
    with pytest.raises(ConfigError, match=next(iter(given))):
        ServiceConfig(**given)


def test_size_strings_only_where_the_field_is_a_size(tmp_path):
    path = tmp_path / "service.json"
    path.write_text(json.dumps({"dram_bytes": "64MiB", "ship_bytes": "8M"}))
    config = config_from_args(start_args("--config", str(path)))
    assert (config.dram_bytes, config.ship_bytes) == (64 << 20, 8 << 20)
    path.write_text(json.dumps({"layers": "4KiB"}))
    with pytest.raises(ConfigError, match='"layers"'):
        config_from_args(start_args("--config", str(path)))
    with pytest.raises(ConfigError, match="--layers"):
        config_from_args(start_args("--layers", "4K"))
    assert parse_size("1.5m") == 3 << 19
    for bad in ("2.5", "-4096", 4096.0, True, "4 XB"):
        with pytest.raises(ConfigError):
            parse_size(bad)


def test_node_is_expanded_after_every_override(monkeypatch):
    service = ServiceConfig(root="/srv/{node}", layers=2, page_bytes=4096)
    monkeypatch.setenv("FLATCAKE_ROOT", "/var/tmp/fc-{node}/x")
    monkeypatch.setenv("FLATCAKE_SSD_DIRS", "/d0/{node}:/d1/{node}")
    first = service.store_config("a" * 16 + "-ray-node-1", 1)
    second = service.store_config("b" * 16 + "-ray-node-2", 2)
    assert first.root == "/var/tmp/fc-" + "a" * 16 + "/x"
    assert first.ssd_dirs == ("/d0/" + "a" * 16, "/d1/" + "a" * 16)
    assert first.root != second.root and set(first.ssd_dirs).isdisjoint(second.ssd_dirs)


def test_errors_name_the_field_and_the_source(tmp_path):
    path = tmp_path / "service.toml"
    path.write_text("[flatcake]\nlayers = 2.5\n")
    with pytest.raises(ConfigError, match=rf'config file {path}: "layers"=2.5: expected an int'):
        config_from_args(start_args("--config", str(path)))
    with pytest.raises(ConfigError, match=r"environment: FLATCAKE_FSYNC='maybe'"):
        ServiceConfig.from_env({"FLATCAKE_FSYNC": "maybe"})
    with pytest.raises(ConfigError, match=r"command line: --ssd-files-per-dir='two'"):
        config_from_args(start_args("--ssd-files-per-dir", "two"))
    with pytest.raises(ConfigError, match=r"unknown field \"ssd_dir\""):
        path.write_text('ssd_dir = ["/a"]\n')
        config_from_args(start_args("--config", str(path)))
    with pytest.raises(ConfigError, match=r"ramp_floor must be in \(0, 1\] \(from command line"):
        build_config(ServiceConfig, Source.flags({"ramp_floor": "0"}))


def test_unreadable_or_invalid_files_are_config_errors(tmp_path):
    missing = tmp_path / "absent.json"
    with pytest.raises(ConfigError, match="cannot read config file"):
        config_from_args(start_args("--config", str(missing)))
    broken = tmp_path / "broken.toml"
    broken.write_text("layers = [")
    with pytest.raises(ConfigError, match="is not valid"):
        config_from_args(start_args("--config", str(broken)))
    listed = tmp_path / "list.json"
    listed.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="one table"):
        config_from_args(start_args("--config", str(listed)))


def test_placement_fields_from_a_file_table_and_the_environment():
    config = build_config(
        StoreConfig,
        Source.arguments(STORE_BASE),
        Source("config file x.json", {"placement": {"tau_tokens": 2048}}, style="file"),
        Source.environment(StoreConfig, {"FLATCAKE_L_AGENT_TOKENS": "4096"}),
    )
    assert config.placement == PlacementConfig(tau_tokens=2048, l_agent_tokens=4096)
    with pytest.raises(ConfigError, match=r"\[placement\]: \"tau_tokens\"=True"):
        build_config(
            StoreConfig,
            Source.arguments(STORE_BASE),
            Source("config file x.json", {"placement": {"tau_tokens": True}}, style="file"),
        )


def test_failpoint_in_config_loading_becomes_a_config_error(tmp_path, failpoints):
    path = tmp_path / "service.json"
    path.write_text("{}")
    failpoints.arm("config.load_file", raises=PermissionError(13, "Permission denied"))
    with pytest.raises(ConfigError, match=f"cannot read config file {path}"):
        config_from_args(start_args("--config", str(path)))
    assert config_from_args(start_args("--config", str(path))).layers == 32  # fired once


# ---- any value from any source: a well-typed config or a ConfigError -------------------------
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner),
    max_leaves=6,
)
python_values = json_values | st.binary(max_size=4) | st.floats() | st.tuples(st.text(max_size=3))
text_values = st.text(max_size=16) | st.sampled_from(["4KiB", "1.5m", "0", "-1", "nan", "1e3"])
fuzz = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@fuzz
@given(name=st.sampled_from(SERVICE_FIELDS), value=json_values)
def test_any_value_in_a_file(tmp_path_factory, name, value):
    path = tmp_path_factory.mktemp("cfg") / "service.json"
    path.write_text(json.dumps({name: value}))
    try:
        config = config_from_args(start_args("--config", str(path)))
    except ConfigError as exc:
        assert f'"{name}"' in str(exc) or name in str(exc)
        return
    assert_well_typed(config)
    assert not (name == "ssd_dirs" and isinstance(value, str))


@fuzz
@given(name=st.sampled_from(SERVICE_FIELDS), value=text_values)
@example(name="dram_chunks", value="0\x1f")  # \s took it as blank, int() did not: ValueError
def test_any_text_in_the_environment(name, value):
    try:
        config = ServiceConfig.from_env({"FLATCAKE_" + name.upper(): value})
    except ConfigError:
        return
    assert_well_typed(config)
    assert_well_typed(config.store_config(NODE, 1, {}))


@fuzz
@given(name=st.sampled_from(STORE_FIELDS), value=python_values)
def test_any_constructor_argument(name, value):
    try:
        config = StoreConfig(**{**STORE_BASE, name: value})
    except ConfigError:
        return
    assert_well_typed(config)


@fuzz
@given(
    flag=st.sampled_from(["--layers", "--page-bytes", "--ssd-files-per-dir", "--dram-bytes"]),
    value=text_values.filter(lambda text: not text.startswith("-")),
)
def test_any_flag_value(flag, value):
    try:
        config = config_from_args(start_args(flag, value))
    except ConfigError as exc:
        assert flag in str(exc) or "(from command line" in str(exc)
        return
    assert_well_typed(config)
