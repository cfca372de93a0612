"""Prompts files, read one way by every command (`evaluate`, `search-tiling`, `distill`)."""

from __future__ import annotations

import json
import os

#: What a prompts file may hold, for error messages and help texts.
PROMPTS_FILE_FORMS = ("a text file with one prompt per line (blank lines and lines starting with '#' skipped) or "
                      "holding a JSON list of them")


_JSON_KINDS = {type(None): "null", dict: "object", str: "string", int: "number", float: "number", bool: "boolean"}


def read_prompts_file(path: str | os.PathLike) -> list[str]:
    """The prompts in the file at `path`: a JSON list of non-empty strings (any file name; a `.json` file must hold
    one), else one prompt per line, stripped, blank lines and '#' comment lines skipped. A first line that starts
    with "[" but is no JSON ("[anime] a dog running") is a prompt. ValueError naming the file for one that cannot
    be read, holds no prompt, or a JSON value other than a list of non-empty strings."""
    name = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"prompts file {name!r} cannot be read ({e}); give {PROMPTS_FILE_FORMS}.") from None
    listed, is_json = None, False
    if text.lstrip().startswith("[") or name.endswith(".json"):
        try:
            listed, is_json = json.loads(text), True
        except json.JSONDecodeError as e:
            if name.endswith(".json"):
                raise ValueError(f"prompts file {name!r} is not valid JSON ({e}); give {PROMPTS_FILE_FORMS}.") from None
    if is_json:                                 # JSON: a list of prompts, or an error (never read as lines)
        return _prompt_list(listed, f"prompts file {name!r}")
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    if not lines:
        raise ValueError(f"prompts file {name!r} holds no prompt; give {PROMPTS_FILE_FORMS}.")
    return lines


def read_prompts_arg(text: str) -> list[str]:
    """A `--prompts` value: an inline JSON list of prompts (`'["a cat", "a dog"]'`) where it starts with "[" and
    names no file, else the prompts file it names (`read_prompts_file`)."""
    if text.lstrip().startswith("[") and not os.path.isfile(text):
        try:
            listed = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--prompts {text!r} is neither a file nor a valid JSON list ({e}); give "
                             f"{PROMPTS_FILE_FORMS}, or a JSON list of prompts.") from None
        return _prompt_list(listed, f"--prompts {text!r}")
    return read_prompts_file(text)


def _prompt_list(listed, where: str) -> list[str]:
    """`listed` (parsed JSON) as a list of stripped prompts, or a ValueError that names `where` it came from."""
    bad = [i for i, p in enumerate(listed) if not isinstance(p, str) or not p.strip()] \
        if isinstance(listed, list) else []
    if not isinstance(listed, list) or not listed or bad:
        what = (f"holds a JSON {_JSON_KINDS.get(type(listed), 'value')}" if not isinstance(listed, list) else
                "holds a JSON list that is empty" if not listed else
                f"holds a JSON list that has {json.dumps(listed[bad[0]])} at position {bad[0]}")
        raise ValueError(f"{where} {what}; a JSON list of prompts holds one or more prompts as non-empty strings.")
    return [p.strip() for p in listed]
