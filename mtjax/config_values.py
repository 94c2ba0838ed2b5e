"""From text to config values: reading an experiment's YAML, splitting `--a.b=v` overrides,
and coercing each value to its field's type.

A mapping that names one key twice is refused (PyYAML would keep the later one silently).
A value that does not fit its field's type gets one line naming the key; an unknown key
names the closest valid one (`suggest`). The short comment after each dataclass field is
its help text (`field_comments`, which `mtjax.config.valid_keys` shows). mtjax.config
builds the experiment's sections from these values; this module does not import it.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import inspect
import math
import re
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from mtjax import textfile
from mtjax.model_config import ConfigError, RopeScaling

__all__ = ["FALSE", "TRUE", "coerce", "construct", "field_comments", "plain", "read_yaml", "split_override", "suggest",
           "type_hints"]


def read_yaml(path: Path) -> dict:
    if path.is_dir():
        raise ConfigError(f"experiment file {path} is a directory; name a YAML file (see experiments/ for examples)")
    if not path.is_file():
        raise ConfigError(f"experiment file {path} does not exist; see experiments/ for examples")
    try:
        tree = _parse_yaml(textfile.read(path), str(path))
    except yaml.YAMLError as e:
        where = getattr(e, "problem_mark", None)
        line = f" at line {where.line + 1}" if where else ""
        raise ConfigError(f"{path} is not valid YAML{line}: {getattr(e, 'problem', e)}") from None
    if tree is None:  # no document: most likely a file not yet written, not a wish for every default
        raise ConfigError(f"{path} is empty: write the settings to change, or leave out the file to run the "
                          "embedded default (`mtjax train` with no EXPERIMENT.yaml)")
    if not isinstance(tree, dict):
        raise ConfigError(f"{path} must hold a mapping of config groups (model, optim, data, ...)")
    return tree


def _parse_yaml(text: str, source: str, in_file: bool = True):
    """yaml.safe_load of `text`, refusing a mapping that names one key twice (PyYAML keeps
    the last one silently, so a file that says a thing twice would mean its later line).
    `source` names the text in the error: a file (`in_file`: with line numbers), or the
    setting whose value it is."""
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is not None:
            _refuse_repeated_keys(node, source, in_file, (), set())
        return loader.construct_document(node) if node is not None else None
    finally:
        loader.dispose()


def _refuse_repeated_keys(node, source: str, in_file: bool, where: tuple[str, ...], seen_nodes: set) -> None:
    if id(node) in seen_nodes:  # an alias of a node already walked
        return
    seen_nodes.add(id(node))
    if isinstance(node, yaml.SequenceNode):
        for item in node.value:
            _refuse_repeated_keys(item, source, in_file, where, seen_nodes)
    if not isinstance(node, yaml.MappingNode):
        return
    lines: dict[str, int] = {}
    for key, value in node.value:
        # A merge key (<<: *base) brings defaults that the mapping's own keys may override.
        if isinstance(key, yaml.ScalarNode) and key.tag != "tag:yaml.org,2002:merge":
            name, line = ".".join((*where, key.value)), key.start_mark.line + 1
            if key.value in lines:
                first = lines[key.value]
                at = "" if not in_file else f" (line {line})" if first == line else f" (lines {first} and {line})"
                raise ConfigError(f"{source} sets {name} twice{at}; keep one of them")
            lines[key.value] = line
            _refuse_repeated_keys(value, source, in_file, (*where, key.value), seen_nodes)
        else:
            _refuse_repeated_keys(value, source, in_file, where, seen_nodes)


def split_override(item: str) -> tuple[str, Any]:
    text = item.removeprefix("--")
    if "=" not in text:
        raise ConfigError(f"override {item!r} needs a value: write --{text}=VALUE")
    key, value = text.split("=", 1)
    return key.strip(), value


def suggest(name: str, candidates, prefix: str = "") -> str:
    close = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.5)
    return f"; did you mean '{prefix}{close[0]}'?" if close else ""


# --- typing ----------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def type_hints(cls) -> dict:
    return typing.get_type_hints(cls)


@functools.lru_cache(maxsize=None)
def field_comments(cls) -> dict[str, str]:
    """The short comment after each field of a dataclass, as its help text."""
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):
        return {}
    return dict(re.findall(r"^\s+(\w+):[^#\n]*#\s*(.+)$", source, flags=re.M))


_NULLS = ("null", "none", "~", "")
TRUE, FALSE = ("true", "yes", "on", "1"), ("false", "no", "off", "0")


def coerce(value, hint, key: str):
    """`value` (from YAML or a command line string) as type `hint`, or a ConfigError."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None or isinstance(value, str) and value.strip().lower() in _NULLS:
            if type(None) in args:
                return None
        inner = [a for a in args if a is not type(None)]
        errors = []
        for a in inner:
            try:
                return coerce(value, a, key)
            except ConfigError as e:
                errors.append(e)
        raise errors[0]
    if hint is Any:
        return value
    if origin is tuple:
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            raise _type_error(key, value, "a list")
        elem = args[0] if args else Any
        return tuple(coerce(v, elem, key) for v in value)
    if dataclasses.is_dataclass(hint):
        if isinstance(value, hint):
            return value
        if isinstance(value, str):
            value = _parse_yaml(value, key, in_file=False)
        if not isinstance(value, dict):
            raise _type_error(key, value, f"a mapping of {hint.__name__} fields")
        sub = type_hints(hint)
        unknown = [k for k in value if k not in sub]
        if unknown:
            raise ConfigError(f"unknown config key '{key}.{unknown[0]}'{suggest(unknown[0], sub, prefix=key + '.')}")
        return construct(key, hint, {k: coerce(v, sub[k], f"{key}.{k}") for k, v in value.items()})
    if hint is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in TRUE + FALSE:
            return value.strip().lower() in TRUE
        raise _type_error(key, value, "true or false")
    if hint is int:
        if isinstance(value, bool):
            raise _type_error(key, value, "an integer")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                number = float(value.replace("_", ""))
            except ValueError:
                raise _type_error(key, value, "an integer") from None
            if number.is_integer():
                return int(number)
        raise _type_error(key, value, "an integer")
    if hint is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):
            try:
                number = float(value)
            except ValueError:
                pass
        if number is None:
            raise _type_error(key, value, "a number")
        if not math.isfinite(number):  # nan and inf parse as floats, and would train to NaN
            raise _type_error(key, value, "a finite number")
        return number
    if hint is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise _type_error(key, value, "a string")
    raise ConfigError(f"{key} has a type mtjax cannot parse from text ({hint})")


def _type_error(key: str, value, expected: str) -> ConfigError:
    return ConfigError(f"{key} must be {expected}, got {value!r}")


def construct(group: str, cls, kwargs: dict):
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (TypeError, ValueError) as e:  # e.g. OptimConfig's own checks
        message = str(e)
        raise ConfigError(message if message.startswith(group) else f"{group}: {message}") from None


def plain(value):
    if isinstance(value, RopeScaling):
        return dataclasses.asdict(value)
    if isinstance(value, tuple):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    return value
