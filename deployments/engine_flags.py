"""Command-line flags made from EngineConfig's fields, as vLLM makes its flags from
EngineArgs: a flag's name, type and default are its field's, and its help and choices the
field's metadata, so the CLI cannot drift from the config."""

import argparse
import json
import types
import typing
from collections.abc import Iterable
from dataclasses import Field, fields

from replica.config import EngineConfig  # torch-free

FIELDS: dict[str, Field] = {f.name: f for f in fields(EngineConfig)}


def flag_name(name: str) -> str:
    """--kv-cache-dtype for kv_cache_dtype."""
    return "--" + name.replace("_", "-")


def add_engine_flags(parser: argparse.ArgumentParser, names: Iterable[str]) -> None:
    """A flag for each named field; its value lands in the namespace under the field's name."""
    for name in names:
        parser.add_argument(flag_name(name), **_flag_options(FIELDS[name]))


def engine_flag_values(args: argparse.Namespace, names: Iterable[str]) -> dict:
    """The named fields' values as parsed: EngineConfig keyword arguments."""
    return {name: getattr(args, name) for name in names}


def _flag_options(f: Field) -> dict:
    options = {"default": f.default, "help": f.metadata.get("help")}
    if "choices" in f.metadata:
        # None is the value no flag gives, not one to type.
        options["choices"] = [choice for choice in f.metadata["choices"] if choice is not None]
    value_types = set(typing.get_args(f.type)) - {types.NoneType} or {f.type}
    if value_types == {bool}:
        options["action"] = "store_true" if f.default is False else argparse.BooleanOptionalAction
    elif dict in value_types:
        options.update(type=_json_value(f.name), metavar="JSON")
    elif value_types in ({int}, {float}):
        options["type"] = value_types.pop()
    elif value_types != {str}:  # argparse's own type is str
        raise TypeError(f"EngineConfig.{f.name}: no flag for a field of type {f.type}")
    return options


def _json_value(name: str):
    """A field that takes a dict takes its JSON text on the command line, checked by the
    config's own checks as the flag is read (bad JSON or an unknown key is an argparse
    error at start), and passed on as the dict, as a serve config's engine_args holds it."""

    def parse(text: str) -> dict:
        try:
            EngineConfig(**{name: text})
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        return json.loads(text)

    return parse
