"""Text files mtjax reads (configs, JSON files a run or a checkpoint holds, templates):
decoded one way everywhere, and a file that is not text in a known encoding is one line
naming it.

The decoding choice: UTF-8, with or without a byte-order mark; a file that starts with a
UTF-16 or UTF-32 byte-order mark (as some Windows editors save) is read in the encoding
the mark names. Anything else that is not UTF-8 (Latin-1 text, binary, a UTF-8 sequence
cut short) is refused with the file's name, the first bad byte's offset and what to do;
guessing another encoding would silently change the text. Raw text corpora read by
`mtjax data prepare` are refused the same way (mtjax.data.prepare).
"""

from __future__ import annotations

import codecs
from pathlib import Path

from mtjax.errors import MtjaxError


class TextError(MtjaxError):
    """A file or argument that is not text in a known encoding."""


_BOMS = [(codecs.BOM_UTF32_LE, "utf-32"), (codecs.BOM_UTF32_BE, "utf-32"),  # before UTF-16: they share a prefix
         (codecs.BOM_UTF8, "utf-8-sig"), (codecs.BOM_UTF16_LE, "utf-16"), (codecs.BOM_UTF16_BE, "utf-16")]


def decode(raw: bytes, where: str | Path, fix: str = "save it as UTF-8") -> str:
    """The text of `raw` (the contents of `where`), or TextError naming `where` and `fix`."""
    encoding = next((enc for bom, enc in _BOMS if raw.startswith(bom)), "utf-8")
    try:
        return raw.decode(encoding)
    except UnicodeDecodeError as e:
        raise TextError(f"{where} is not {encoding.upper().removesuffix('-SIG')} text ({_detail(e)}); {fix}") from None


def read(path: str | Path) -> str:
    """The text of the file at `path` (see the module's docstring for the encodings read)."""
    return decode(Path(path).read_bytes(), path)


def argument(value: str, name: str) -> str:
    """`value`, a command-line argument used as text (Python keeps bytes that are not
    UTF-8 as lone surrogates, which no tokenizer takes), or TextError naming `name`."""
    return decode(value.encode("utf-8", "surrogateescape"), name,
                  "pass it as UTF-8 (is the terminal's locale UTF-8?)")


def _detail(e: UnicodeError) -> str:
    if isinstance(e, UnicodeDecodeError):
        if e.reason == "unexpected end of data":
            return f"it ends inside a character at byte {e.start}"
        return f"byte 0x{e.object[e.start]:02x} at offset {e.start}"
    return f"{e.reason} at character {getattr(e, 'start', '?')}"


def describe(e: UnicodeError) -> str:
    """One line for a UnicodeError met where no file name is known (the command line's last resort)."""
    if isinstance(e, UnicodeEncodeError) and "surrogate" in e.reason:
        return (f"some text holds bytes that are not UTF-8 ({_detail(e)}), e.g. an argument given in another "
                "encoding; pass it as UTF-8")
    return f"some input is not UTF-8 text ({_detail(e)}); save it as UTF-8"
