"""Typed-dataclass config machinery: YAML + dotted overrides, did-you-mean errors.

Every section of the run config is a dataclass living next to the code it configures
(``megasparse/loss/config.py`` and so on); ``megasparse/config.py`` composes them. This
module only knows how to turn nested dicts into those dataclasses and report bad keys.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import re
import types
import typing
from typing import Any, TypeVar

T = TypeVar("T")


class ConfigError(ValueError):
    """A bad config value; the message is one line naming the key and the fix."""


def _suggest(key: str, options: list[str]) -> str:
    close = difflib.get_close_matches(key, options, n=1, cutoff=0.5)
    return f" (did you mean '{close[0]}'?)" if close else f" (valid keys: {', '.join(sorted(options))})"


def _describe(tp: Any) -> str:
    """How an error names one alternative of a union: its literal values, or the kind of value it takes."""
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        return ", ".join(str(a) for a in typing.get_args(tp))
    if origin in (list, tuple):
        return "a list"
    if origin is dict or dataclasses.is_dataclass(tp):
        return "a mapping"
    return {int: "an integer", float: "a number", bool: "true/false", str: "a string"}.get(tp, str(tp))


def _union_error(value: Any, args: tuple, errors: list[str], path: str) -> str:
    """One line for a value no alternative of a union took. A list (mapping) gets the list (mapping) alternative's
    own error, which names the bad entry; anything else gets every accepted form, with a did-you-mean over the
    union's literal values (``parallel.layer_split='autp'``: a list, auto or null (did you mean 'auto'?))."""
    non_none = [a for a in args if a is not type(None)]
    if len(non_none) == 1:
        return errors[0]
    for a, err in zip(non_none, errors):
        origin = typing.get_origin(a)
        if isinstance(value, (list, tuple)) and origin in (list, tuple):
            return err
        if isinstance(value, dict) and (origin is dict or dataclasses.is_dataclass(a)):
            return err
    forms = [_describe(a) for a in non_none] + (["null"] if type(None) in args else [])
    literals = [str(v) for a in non_none if typing.get_origin(a) is typing.Literal for v in typing.get_args(a)]
    close = difflib.get_close_matches(str(value).lower(), literals, n=1, cutoff=0.5)  # AUTO: 'auto'
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    return f"{path}={value!r}: use {', '.join(forms[:-1])} or {forms[-1]}{hint}"


def _coerce(value: Any, tp: Any, path: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        non_none = [a for a in args if a is not type(None)]
        errors = []
        for a in non_none:
            try:
                return _coerce(value, a, path)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(_union_error(value, args, errors, path))
    if origin is typing.Literal:
        if isinstance(value, bool) and ("on" if value else "off") in args:  # YAML 1.1's bare off/on
            value = "on" if value else "off"
        if value not in args:
            close = difflib.get_close_matches(str(value), [str(a) for a in args], n=1, cutoff=0.5)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise ConfigError(f"{path}={value!r}: use one of {', '.join(str(a) for a in args)}{hint}")
        return value
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path}: expected a list, got {value!r}")
        inner = args[0] if args else Any
        return [_coerce(v, inner, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping, got {value!r}")
        return dict(value)
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a section (mapping), got {value!r}")
        return from_dict(tp, value, path)
    if tp is Any:
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ConfigError(f"{path}: expected true/false, got {value!r}")
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise ConfigError(f"{path}: expected an integer, got {value!r}")
        try:
            f = float(value)
        except ValueError as e:
            raise ConfigError(f"{path}: expected an integer, got {value!r}") from e
        if f != int(f):
            raise ConfigError(f"{path}: expected an integer, got {value!r}")
        return int(f)
    if tp is float:
        if isinstance(value, bool):
            raise ConfigError(f"{path}: expected a number, got {value!r}")
        try:
            return float(value)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"{path}: expected a number, got {value!r}") from e
    if tp is str:
        if isinstance(value, bool):  # YAML 1.1 reads a bare off/on/no/yes as a bool
            return "on" if value else "off"
        if not isinstance(value, (str, int, float)):
            raise ConfigError(f"{path}: expected a string, got {value!r}")
        return str(value)
    return value


def check_renamed(cls: type, key: str, value: Any, full: str) -> None:
    """ConfigError naming the new spelling when ``value`` is one a section renamed (its ``RENAMED`` class attribute:
    {field: {old value: new value}}): an old name fails with the fix rather than living on beside the new one."""
    new = getattr(cls, "RENAMED", {}).get(key, {}).get(value) if isinstance(value, str) else None
    if new is not None:
        raise ConfigError(f"{full}={value} was renamed: use {full}={new}")


def from_dict(cls: type[T], data: dict, path: str = "") -> T:
    """Build dataclass ``cls`` from a nested dict, rejecting unknown keys with a suggestion."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in (data or {}).items():
        full = f"{path}.{key}" if path else key
        if key not in fields:
            raise ConfigError(f"unknown config key '{full}'{_suggest(key, list(fields))}")
        check_renamed(cls, key, value, full)
        kwargs[key] = _coerce(value, hints[key], full)
    return cls(**kwargs)


def to_dict(obj: Any) -> Any:
    """Plain nested dict of a config (for YAML dumps, checkpoints and metrics headers)."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    return obj


def apply_override(data: dict, cls: type, dotted: str) -> None:
    """Apply ``a.b.c=value`` to the nested dict ``data``; the value is parsed as YAML."""
    import yaml

    if "=" not in dotted:
        raise ConfigError(f"override '{dotted}' must look like section.key=value")
    key, raw = dotted.split("=", 1)
    parts = key.strip().split(".")
    node, node_cls = data, cls
    for i, part in enumerate(parts):
        names = [f.name for f in dataclasses.fields(node_cls)]
        so_far = ".".join(parts[: i + 1])
        if part not in names:
            raise ConfigError(f"unknown config key '{so_far}'{_suggest(part, names)}")
        tp = typing.get_type_hints(node_cls)[part]
        if i == len(parts) - 1:
            node[part] = yaml.safe_load(raw) if raw != "" else ""
        else:
            if not dataclasses.is_dataclass(tp):
                raise ConfigError(f"'{so_far}' is a value, not a section")
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
            node_cls = tp


_OVERRIDE = re.compile(r"[A-Za-z_][\w.]*=")


def parse_with_overrides(
    parser: argparse.ArgumentParser, argv: list[str], dest: str = "overrides"
) -> argparse.Namespace:
    """``parser.parse_args(argv)`` that takes ``key.sub=value`` overrides anywhere on the line, also after options.

    argparse fills a ``nargs="*"`` positional once, from the first run of positionals, so ``CONFIG --steps 4 a=1``
    left ``a=1`` unrecognised. Here the leftovers that look like overrides are appended, in order, to ``dest`` (the
    parser's own ``nargs="*"`` positional); anything else is still an error (exit 2 with argparse's usage line)."""
    ns, rest = parser.parse_known_args(argv)
    bad = [t for t in rest if not _OVERRIDE.match(t)]
    if bad:
        parser.error(f"unrecognized arguments: {' '.join(bad)}")
    setattr(ns, dest, [*(getattr(ns, dest, None) or []), *rest])
    return ns
