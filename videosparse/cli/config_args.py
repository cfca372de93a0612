"""The flags of a config dataclass (`videosparse distill`, `videosparse search-tiling`): one `--field-name` per field
and `--config FILE` to start from, read back into the config."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from typing import Any

from ..distill.config import TilingSearchConfig, _bool_fields
from ..validation import bool_word


def _cli_value(text: str) -> Any:
    """A flag's value: JSON when it parses (numbers, lists, null, true/false), else a number in Python's spelling
    (.1, 5., +5, 1e-3), else the plain string."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        pass
    for number in (int, float):
        try:
            value = number(text)
        except ValueError:
            continue
        if math.isfinite(value):
            return value
    return text


def _cli_text(text: str) -> str | None:
    """A text field's value (a path, a hub id, a name) as given, even when it reads as a number; null: None."""
    return None if text == "null" else text


def _cli_prompts(text: str) -> Any:
    """--prompts: a JSON list when it starts with '[', else a file path as given (a file named 7 stays a path)."""
    return _cli_value(text) if text.lstrip().startswith("[") else text


def _cli_bool(text: str) -> bool:
    """A bool flag's value (`videosparse.validation.bool_word`: true/false, on/off, yes/no, 1/0 in any case); anything
    else is an argparse error."""
    try:
        return bool_word(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


# flag help beyond "default: ..." for fields whose accepted values are not obvious
_FIELD_HELP = {
    "model": "hub id or local directory; 'reference' (the shipped model, offline; None means it) or 'tiny'",
    "prompts": """a text file with one prompt per line (blank and '#' lines skipped) or holding a JSON list, or a """
               """JSON list of prompts: '["a cat", """
               """"a dog"]'; one prompt: '["a cat"]' (a plain string is read as a file path, never as a prompt)""",
    "tiling": "tile shape like 4x4x8 or [4,4,8] with pt*ph*pw = block, or a tiling JSON from `videosparse "
              "search-tiling`; None: VedaConfig's shape for the block (4x4x8 for 128, 4x4x4 for 64)",
}


def add_config_arguments(parser, cls) -> None:
    """Add `--config` (a JSON file to start from) and one `--field-name` flag per dataclass field of `cls`.

    Values are parsed as JSON when possible (`--tiling [8,4,4]`, `--max-steps 100`, `null` for None, which then
    overrides a `--config` value too), else as numbers in Python's spelling (`.1`, `5.`), else taken as strings;
    text fields (paths, hub ids, names: `--output-dir 2024`, `--model reference`) are taken as given (`null`:
    None), and `--prompts` is a JSON list when it starts with '[' (`'["a cat", "a dog"]'`), else a file path; bool
    fields take true/false, on/off, yes/no or 1/0 (any case) and nothing else.
    """
    source = ("a tiling JSON search-tiling wrote, which records its settings" if cls is TilingSearchConfig
              else "a run's distill_config.json")
    parser.add_argument("--config", help=f"JSON {cls.__name__} to start from ({source}); the flags given override it")
    bools = _bool_fields(cls)
    for f in dataclasses.fields(cls):
        flag = "--" + f.name.replace("_", "-")
        parse = (_cli_prompts if f.name == "prompts" else
                 _cli_text if str(f.type).replace(" | None", "") == "str" else _cli_value)
        if f.name in bools:                             # strict: "False" must not become a truthy string
            parser.add_argument(flag, dest=f.name, type=_cli_bool, nargs="?", const=True, default=argparse.SUPPRESS,
                                metavar="{true,false}",
                                help=f"true or false (also on/off, yes/no, 1/0); {flag} alone: true; "
                                     f"default: {f.default!r}")
        elif f.name in _FIELD_HELP:
            parser.add_argument(flag, dest=f.name, type=parse, default=argparse.SUPPRESS,
                                help=f"{_FIELD_HELP[f.name]}; default: {f.default!r}")
        else:
            parser.add_argument(flag, dest=f.name, type=parse, default=argparse.SUPPRESS,
                                help=f"default: {f.default!r}")


def config_from_namespace(ns, cls):
    """The config of class `cls` from `--config` (if any) overridden by the flags that were given (a flag given as
    `null` sets None over the file's value)."""
    data: dict[str, Any] = {}
    if getattr(ns, "config", None):
        try:
            with open(ns.config) as f:
                data = json.load(f)
        except (OSError, ValueError) as err:
            raise ValueError(f"--config {ns.config!r} cannot be read as JSON ({err}).") from None
        if isinstance(data, dict) and isinstance(data.get("search_config"), dict):
            data = dict(data["search_config"])          # a tiling JSON from search-tiling: the settings it recorded
        if not isinstance(data, dict):
            raise ValueError(f"--config {ns.config!r} holds a {type(data).__name__}; expected a JSON object of "
                             f"{cls.__name__} fields.")
    for f in dataclasses.fields(cls):
        if hasattr(ns, f.name):          # given (flags not given are absent), `null` included: None overrides too
            data[f.name] = getattr(ns, f.name)
    return cls.from_dict(data)
