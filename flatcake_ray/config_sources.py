"""Typed reading of configuration values from every source (see ``config.py`` for the fields).

A config dataclass's fields are typed ``int``, ``float``, ``bool``, ``str``,
``tuple[str, ...]`` or a nested config dataclass; an ``int`` field whose name ends in
``_bytes`` is a *size*. A :class:`Source` is one mapping of field name to value, with a name
for error messages, and says whether its values are text (environment variables, command-line
flags: parsed) or typed values (constructor arguments, a JSON/TOML file: checked, never
guessed). :func:`build_config` merges sources in order (later ones win), reads each value by
its field's type, expands the templates (``{node}``, ``{host}``, ``{slot}``, ``{namespace}``)
in ``root`` and ``ssd_dirs`` after the last override, and builds the config; every mistake
is a :class:`ConfigError` naming the field and the source it came from:

- an int is an int: not a bool, not ``2.5``, not ``"3"`` in a file (text sources parse
  ``"3"``); a float is an int or a finite float; a bool is a bool (text: 1/0, true/false,
  yes/no, on/off);
- a size is an int or a size string (``512MiB``, ``4G``, ``1.5m``, ``65536``; powers of 1024)
  that comes to a whole number of bytes; nowhere else is a size string read;
- a list of folders is a list of non-empty strings (text: ``:``-separated); a string where a
  list belongs is an error, never one folder per character;
- unknown field names in a file or in arguments are errors (typos do not pass silently).
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields, is_dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any, TypeVar, cast, get_type_hints

from flatcake_ray.errors import ConfigError
from flatcake_ray.failpoints import failpoint

ENV_PREFIX = "FLATCAKE_"
NODE_TEMPLATE = "{node}"
TEMPLATED_FIELDS = ("root", "ssd_dirs")
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b)?\s*$", re.IGNORECASE)
# ASCII blanks only: int() refuses the other characters Unicode calls spaces (e.g. "\x1f").
_INT_RE = re.compile(r"^\s*-?[0-9]+\s*$", re.ASCII)
_SIZE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")

T = TypeVar("T")


def parse_size(value: Any) -> int:
    """``"64KiB" -> 65536``, ``"1.5m" -> 1572864``; an int passes through. A bool, a float, a
    negative size or one that is not a whole number of bytes (``"2.5"``) is a ConfigError."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral | str):
        raise ConfigError(f"a size is an int or a size string, not {type(value).__name__}")
    if isinstance(value, numbers.Integral):
        if value < 0:
            raise ConfigError(f"a size may not be negative ({value})")
        return int(value)
    match = _SIZE_RE.match(value)
    if not match:
        raise ConfigError(f"cannot read {value!r} as a size (e.g. 512MiB, 4G, 65536)")
    nbytes = Fraction(match.group(1)) * _SIZE_UNITS[match.group(2).lower()]
    if nbytes.denominator != 1:
        raise ConfigError(f"{value!r} is not a whole number of bytes")
    return int(nbytes)


# ---- one value by its field's kind ---------------------------------------------------------
def _read_int(value: Any, text: bool) -> int:
    if text and isinstance(value, str) and _INT_RE.match(value):
        return int(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ConfigError(f"expected an int, got {_shown(value)}")
    return int(value)


def _read_float(value: Any, text: bool) -> float:
    if text and isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            raise ConfigError(f"expected a number, got {value!r}") from None
    elif isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ConfigError(f"expected a number, got {_shown(value)}")
    else:
        number = float(value)
    if not math.isfinite(number):
        raise ConfigError(f"expected a finite number, got {value!r}")
    return number


def _read_bool(value: Any, text: bool) -> bool:
    if isinstance(value, bool):
        return value
    if text and isinstance(value, str):
        lowered = value.strip().lower()
        if lowered in _TRUE or lowered in _FALSE:
            return lowered in _TRUE
    raise ConfigError(f"expected a bool (true/false), got {_shown(value)}")


def _read_str(value: Any, text: bool) -> str:
    if not isinstance(value, str):
        raise ConfigError(f"expected a string, got {_shown(value)}")
    if "\0" in value:
        raise ConfigError("a string may not hold a NUL character")
    return value


def _read_paths(value: Any, text: bool) -> tuple[str, ...]:
    if text and isinstance(value, str):
        value = [part for part in value.split(":") if part]
    if not isinstance(value, list | tuple):
        raise ConfigError(f"expected a list of folders, got {_shown(value)}")
    for item in value:
        if not isinstance(item, str) or not item or "\0" in item:
            raise ConfigError(f"each folder is a non-empty string, got {_shown(item)}")
    return tuple(value)


def _read_size(value: Any, text: bool) -> int:
    return parse_size(value)


_READERS: dict[str, Callable[[Any, bool], Any]] = {
    "int": _read_int,
    "float": _read_float,
    "bool": _read_bool,
    "str": _read_str,
    "paths": _read_paths,
    "size": _read_size,
}


def _shown(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 60 else text[:57] + '...'}"


_KINDS: dict[type, dict[str, Any]] = {}


def field_kinds(cls: type) -> dict[str, Any]:
    """Field name -> kind name, or the nested config class (read once per class)."""
    kinds = _KINDS.get(cls)
    if kinds is None:
        kinds = _KINDS[cls] = _field_kinds(cls)
    return kinds


def _field_kinds(cls: type) -> dict[str, Any]:
    hints = get_type_hints(cls)
    kinds: dict[str, Any] = {}
    for item in fields(cls):
        hint = hints[item.name]
        if is_dataclass(hint):
            kinds[item.name] = hint
        elif hint is int:
            kinds[item.name] = "size" if item.name.endswith("_bytes") else "int"
        elif hint in (float, bool, str):
            kinds[item.name] = hint.__name__
        elif hint == tuple[str, ...]:
            kinds[item.name] = "paths"
        else:
            raise TypeError(f"{cls.__name__}.{item.name}: no reader for {hint}")
    return kinds


def read_value(kind: str, value: Any, *, text: bool = False) -> Any:
    """``value`` as a field of ``kind`` holds it; a ConfigError says what was expected."""
    return _READERS[kind](value, text)


def normalise(config: Any, source: str = "arguments") -> None:
    """Check and normalise a constructed config's own fields in place (``__post_init__``)."""
    for name, kind in field_kinds(type(config)).items():
        value = getattr(config, name)
        if isinstance(kind, type):
            if not isinstance(value, kind):
                raise ConfigError(
                    f"{source}: {name} must be a {kind.__name__}, got {_shown(value)}"
                )
            continue
        try:
            object.__setattr__(config, name, read_value(kind, value))
        except ConfigError as exc:
            raise ConfigError(f"{source}: {name}={value!r}: {exc}", name) from None


# ---- sources ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Source:
    """One mapping of field names to values, where it came from, and whether it is text."""

    name: str
    values: Mapping[str, Any]
    text: bool = False
    style: str = "argument"  # how fields are spelled in messages: argument, file, env, flag

    def spell(self, field_name: str) -> str:
        if self.style == "env":
            return ENV_PREFIX + field_name.upper()
        if self.style == "flag":
            return "--" + field_name.replace("_", "-")
        if self.style == "file":
            return json.dumps(field_name)
        return field_name

    @classmethod
    def arguments(cls, values: Mapping[str, Any], name: str = "arguments") -> Source:
        return cls(name, dict(values))

    @classmethod
    def flags(cls, values: Mapping[str, Any]) -> Source:
        return cls("command line", {k: v for k, v in values.items() if v is not None}, True, "flag")

    @classmethod
    def environment(cls, config_cls: type, environ: Mapping[str, str] | None = None) -> Source:
        """The ``FLATCAKE_*`` variables naming fields of ``config_cls`` (nested ones too)."""
        environ = os.environ if environ is None else environ
        found = {}
        for name in _all_field_names(config_cls):
            raw = environ.get(ENV_PREFIX + name.upper())
            if raw is not None:
                found[name] = raw
        return cls("environment", found, True, "env")

    @classmethod
    def file(cls, path: str | os.PathLike[str]) -> Source:
        return cls(f"config file {path}", load_file(path), False, "file")


def load_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A JSON or TOML (``.toml``) file's table of fields; a ``flatcake`` sub-table if present."""
    try:
        failpoint("config.load_file", path=path)
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read config file {path}: {exc}") from None
    try:
        if str(path).endswith(".toml"):
            import tomllib

            data = tomllib.loads(text)
        else:
            data = json.loads(text)
    except ValueError as exc:  # JSONDecodeError and TOMLDecodeError are ValueErrors
        raise ConfigError(f"config file {path} is not valid: {exc}") from None
    data = data.get("flatcake", data) if isinstance(data, dict) else data
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold one table/object of fields")
    return data


def _all_field_names(cls: type) -> list[str]:
    names = []
    for name, kind in field_kinds(cls).items():
        names.extend(_all_field_names(kind) if isinstance(kind, type) else [name])
    return names


# ---- building --------------------------------------------------------------------------------
@dataclass
class _Merged:
    values: dict[str, Any] = dataclasses.field(default_factory=dict)
    origins: dict[str, str] = dataclasses.field(default_factory=dict)  # field -> "source: name"
    nested: dict[str, _Merged] = dataclasses.field(default_factory=dict)

    def set(self, name: str, value: Any, source: Source) -> None:
        self.values[name] = value
        self.origins[name] = f"{source.name}: {source.spell(name)}"


def _nested_owner(kinds: dict[str, Any], name: str) -> str | None:
    for owner, kind in kinds.items():
        if isinstance(kind, type) and name in field_kinds(kind):
            return owner
    return None


def _take(cls: type, merged: _Merged, source: Source, name: str, value: Any) -> None:
    kinds = field_kinds(cls)
    kind = kinds.get(name)
    if kind is None:
        owner = _nested_owner(kinds, name)
        if owner is None:
            known = ", ".join(sorted(_all_field_names(cls)))
            raise ConfigError(f"{source.name}: unknown field {source.spell(name)} (known: {known})")
        _take(kinds[owner], merged.nested.setdefault(owner, _Merged()), source, name, value)
    elif isinstance(kind, type):
        _take_nested(kind, merged, source, name, value)
    else:
        try:
            merged.set(name, read_value(kind, value, text=source.text), source)
        except ConfigError as exc:
            raise ConfigError(
                f"{source.name}: {source.spell(name)}={_clip(value)}: {exc}", name
            ) from None


def _take_nested(kind: type, merged: _Merged, source: Source, name: str, value: Any) -> None:
    inner = merged.nested.setdefault(name, _Merged())
    if isinstance(value, kind):
        for item in fields(kind):
            inner.set(item.name, getattr(value, item.name), source)
    elif isinstance(value, Mapping) and not source.text:
        for key, item in value.items():
            _take(
                kind, inner, Source(f"{source.name} [{name}]", {}, False, source.style), key, item
            )
    else:
        raise ConfigError(f"{source.name}: {source.spell(name)} must be a table of fields", name)


def _clip(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _expand(merged: _Merged, templates: Mapping[str, str]) -> None:
    def expand(text: str) -> str:
        for template, value in templates.items():
            text = text.replace(template, value)
        return text

    for name in TEMPLATED_FIELDS:
        value = merged.values.get(name)
        if isinstance(value, str):
            merged.values[name] = expand(value)
        elif isinstance(value, tuple):
            merged.values[name] = tuple(expand(v) for v in value)


def _construct(cls: type[T], merged: _Merged) -> T:
    values = dict(merged.values)
    for name, inner in merged.nested.items():
        values[name] = _construct(field_kinds(cls)[name], inner)
    missing = [f.name for f in fields(cast(Any, cls)) if f.name not in values and _required(f)]
    if missing:
        raise ConfigError(f"{cls.__name__} needs {', '.join(missing)}")
    try:
        return cls(**values)
    except ConfigError as exc:
        named = [merged.origins[n] for n in exc.fields if n in merged.origins]
        if not named:
            raise
        raise ConfigError(f"{exc} (from {'; '.join(named)})", *exc.fields) from None


def _required(item: dataclasses.Field) -> bool:
    return item.default is dataclasses.MISSING and item.default_factory is dataclasses.MISSING


def build_config(cls: type[T], *sources: Source, templates: Mapping[str, str] | None = None) -> T:
    """``cls`` from ``sources`` (later ones override earlier ones), each value read by its
    field's type; each of ``templates`` (``{"{node}": ...}``) in ``root`` and ``ssd_dirs``
    becomes its value after the last override. Every mistake is a :class:`ConfigError`
    naming the field and its source."""
    failpoint("config.build", cls=cls)
    merged = _Merged()
    for source in sources:
        if not isinstance(source.values, Mapping):
            raise ConfigError(f"{source.name} must be a table of fields")
        for name, value in source.values.items():
            if not isinstance(name, str):
                raise ConfigError(f"{source.name}: field names are strings, got {name!r}")
            _take(cls, merged, source, name, value)
    if templates:
        _expand(merged, templates)
    return _construct(cls, merged)
