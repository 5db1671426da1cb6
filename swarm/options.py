"""Flat options onto a tree of config dataclasses: one routing rule, derived from the fields.

A config tree is a frozen dataclass whose fields are settings or nested config dataclasses
(``SwarmConfig`` holds a ``PeerConfig`` and an ``AveragingConfig``), marked with
``field(..., metadata=SECTION)``; a dataclass value that is not marked (a ``Membership``) is one
setting. Every setting of the tree
has one name, unique across the tree, so a flat keyword finds its owner without a hand-kept list:

- :func:`build_tree` turns ``{"inner_steps": 50, "relay_peers": 0}`` into the tree;
- :func:`environment_options` reads the same names from ``SWARM_<NAME>`` variables;
- :func:`leaf_fields` lists every setting with its owner, for flags, docs and tests.

An unknown name raises :class:`~swarm.errors.ConfigError` naming the closest valid one.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from swarm.errors import ConfigError

T = typing.TypeVar("T")
SECTION = {"section": True}  # field metadata of a nested config
ENV_PREFIX = "SWARM_"
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


@dataclass(frozen=True)
class Leaf:
    """One setting of a config tree."""

    name: str  # the field's name, which is also its flat keyword
    path: tuple[str, ...]  # the sections leading to its config: () for the root, ("peer",)
    owner: type  # the config dataclass that defines it
    hint: Any  # its resolved type annotation

    @property
    def env(self) -> str:
        """The environment variable that sets it: ``SWARM_`` and the name in capitals."""
        return ENV_PREFIX + self.name.upper()


def sections(config: type) -> dict[str, type]:
    """The fields of ``config`` that hold nested configs (marked ``SECTION``), with their types."""
    hints = typing.get_type_hints(config)
    return {f.name: hints[f.name] for f in dataclasses.fields(config) if f.metadata.get("section")}


def leaf_fields(config: type, path: tuple[str, ...] = ()) -> dict[str, Leaf]:
    """Every setting of the tree rooted at ``config``, by name.

    Raises:
        ConfigError: two settings of the tree share a name (a flat keyword would be ambiguous).
    """
    hints = typing.get_type_hints(config)
    nested = sections(config)
    found: dict[str, Leaf] = {}
    for f in dataclasses.fields(config):
        below = (
            leaf_fields(nested[f.name], (*path, f.name))
            if f.name in nested
            else {f.name: Leaf(f.name, path, config, hints[f.name])}
        )
        for name, leaf in below.items():
            if name in found or name in nested:
                raise ConfigError(f"config field {name!r} is defined twice in the tree")
            found[name] = leaf
    return found


def closest(name: str, valid: typing.Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the nearest valid name, or an empty string."""
    match = difflib.get_close_matches(name, list(valid), n=1, cutoff=0.6)
    return f" (did you mean {match[0]!r}?)" if match else ""


def build_tree(config: type[T], options: Mapping[str, Any]) -> T:
    """Build ``config`` from flat ``options`` (section names may pass whole nested configs).

    Raises:
        ConfigError: an unknown option, or what the configs' own checks raise.
    """
    leaves = leaf_fields(config)
    nested = sections(config)
    unknown = [k for k in options if k not in leaves and k not in nested]
    if unknown:
        valid = sorted({*leaves, *nested})
        name = unknown[0]
        raise ConfigError(f"unknown option {name!r}{closest(name, valid)}")
    return _build(config, (), options, leaves)


def _build(config: type[T], path: tuple[str, ...], options: Mapping[str, Any], leaves: Any) -> T:
    own = {k: v for k, v in options.items() if k in leaves and leaves[k].path == path}
    kwargs: dict[str, Any] = {}
    for name, kind in sections(config).items():
        below = {k for k, leaf in leaves.items() if leaf.path[: len(path) + 1] == (*path, name)}
        given = options.get(name)
        if given is not None and not isinstance(given, kind):
            article = "an" if kind.__name__[0] in "AEIOU" else "a"
            raise ConfigError(
                f"{name} must be {article} {kind.__name__}, got {type(given).__name__}"
            )
        flat = {k: options[k] for k in below if k in options}
        if given is not None:
            kwargs[name] = _replace(given, (*path, name), flat, leaves) if flat else given
        elif flat:
            kwargs[name] = _build(kind, (*path, name), flat, leaves)
    try:
        return config(**own, **kwargs)
    except TypeError as e:  # a field the dataclass refuses by construction
        raise ConfigError(f"{config.__name__}: {e}") from None


def _replace(base: Any, path: tuple[str, ...], flat: Mapping[str, Any], leaves: Any) -> Any:
    """``base`` with the flat options of its subtree applied on top."""
    own = {k: v for k, v in flat.items() if leaves[k].path == path}
    deeper = {k: v for k, v in flat.items() if leaves[k].path != path}
    nested = {}
    for name in sections(type(base)):
        sub = {k: v for k, v in deeper.items() if leaves[k].path[: len(path) + 1] == (*path, name)}
        if sub:
            nested[name] = _replace(getattr(base, name), (*path, name), sub, leaves)
    return dataclasses.replace(base, **own, **nested)


def environment_options(
    config: type, environ: Mapping[str, str] | None = None, *, skip: typing.Iterable[str] = ()
) -> dict[str, Any]:
    """The settings of the tree that ``SWARM_<NAME>`` variables set, parsed by field type.

    Booleans take 1/0, true/false, yes/no, on/off; tuples take comma- or space-separated items;
    an optional setting takes ``none``. Settings whose type is not text, a number, a flag or a
    tuple of text (a :class:`~swarm.auth.Membership`) have no variable.

    Raises:
        ConfigError: a variable's value does not parse (the message names the variable).
    """
    environ = os.environ if environ is None else environ
    found: dict[str, Any] = {}
    skipped = set(skip)
    for name, leaf in leaf_fields(config).items():
        text = environ.get(leaf.env)
        if text is None or name in skipped or parser_of(leaf.hint) is None:
            continue
        try:
            found[name] = parse_value(leaf.hint, text)
        except ValueError as e:
            raise ConfigError(f"{leaf.env}={text!r}: {e}") from None
    return found


def parser_of(hint: Any) -> str | None:
    """How text becomes a value of ``hint``: bool, int, float, tuple, text, an integer or a word
    (``int | str``); None: it cannot."""
    args = set(typing.get_args(hint)) if _is_union(hint) else {hint}
    args.discard(type(None))
    if any(typing.get_origin(a) is typing.Literal for a in args):
        args = {str if typing.get_origin(a) is typing.Literal else a for a in args}
    if args == {bool}:
        return "bool"
    if args == {int}:
        return "int"
    if args == {int, str}:
        return "int_or_str"
    if args <= {int, float} and args:
        return "float"
    if any(typing.get_origin(a) is tuple for a in args):
        return "tuple"
    if str in args:
        return "str"
    return None


def parse_value(hint: Any, text: str) -> Any:
    """Parse ``text`` as a value of ``hint`` (see :func:`environment_options`).

    Raises:
        ValueError: it does not parse.
    """
    kind = parser_of(hint)
    optional = _is_union(hint) and type(None) in typing.get_args(hint)
    stripped = text.strip()
    if optional and stripped.lower() == "none":
        return None
    if kind == "bool":
        if stripped.lower() in _TRUE:
            return True
        if stripped.lower() in _FALSE:
            return False
        raise ValueError(f"not one of {', '.join(_TRUE + _FALSE)}")
    if kind == "int":
        try:
            return int(stripped)
        except ValueError:
            raise ValueError("not an integer") from None
    if kind == "int_or_str":
        if stripped.lstrip("-").isdigit():
            return int(stripped)
        words = _words(hint)
        if words and stripped not in words:
            raise ValueError(f"not an integer or one of {', '.join(words)}")
        return stripped
    if kind == "float":
        try:
            return float(stripped)
        except ValueError:
            raise ValueError("not a number") from None
    if kind == "tuple":
        return tuple(item for item in stripped.replace(",", " ").split() if item)
    if kind == "str":
        return stripped
    raise ValueError(f"a {hint} cannot be given as text")


def _words(hint: Any) -> tuple[str, ...]:
    """The text values a ``Literal`` part of ``hint`` allows (none: any text)."""
    return tuple(
        w
        for a in typing.get_args(hint)
        if typing.get_origin(a) is typing.Literal
        for w in typing.get_args(a)
    )


def _is_union(hint: Any) -> bool:
    return typing.get_origin(hint) in (typing.Union, types.UnionType)
