"""JSON files that people edit (a Hugging Face config.json, a hardware profile), read
refusing an object that names a key twice: `json.loads` keeps the last one silently."""

from __future__ import annotations

import json
import re

from mtjax.errors import MtjaxError


class RepeatedKey(MtjaxError, ValueError):
    """A JSON object names one key twice."""


def loads(text: str, source: str):
    """json.loads of `text` (the contents of `source`), refusing a repeated key."""

    def pairs(items: list) -> dict:
        seen = set()
        for key, _ in items:
            if key in seen:
                raise RepeatedKey(f"{source} sets {key} twice{_lines(text, key)}; keep one of them")
            seen.add(key)
        return dict(items)

    return json.loads(text, object_pairs_hook=pairs)


def _lines(text: str, key: str) -> str:
    """' (lines a and b)' where the key is written exactly twice in the file, else ''
    (the same key in several objects leaves which two are meant unsaid)."""
    at = [text.count("\n", 0, m.start()) + 1 for m in re.finditer(re.escape(json.dumps(key)) + r"\s*:", text)]
    return f" (lines {at[0]} and {at[1]})" if len(at) == 2 and at[0] != at[1] else ""
