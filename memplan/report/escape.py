"""Names are data: the one place where text that came from a user's file or option (model and GPU names, paths,
notes that quote them) is made safe for each output. Control characters (newlines, escape sequences) are shown as
escapes, never sent raw; rich markup ([/], [link=...]) is escaped for the terminal tables; `|` is escaped in
Markdown cells; long names are shortened on the terminal (a 50 KB name must not stall rich's layout). JSON and CSV
keep the text itself (their writers quote it)."""

from __future__ import annotations

import re

from rich.markup import escape as _rich_escape

NAME_LIMIT = 120  # characters of a name a terminal table shows
NOTE_LIMIT = 2000  # characters of a note (which may quote a name) on the terminal: rich's highlighter is quadratic-ish


def _escape_char(match: re.Match) -> str:
    return match.group(0).encode("unicode_escape").decode("ascii")


# C0 / C1 controls, DEL, and the invisible format characters that reorder or hide text (bidirectional overrides,
# zero-width characters, the line and paragraph separators)
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u00ad\u061c\u180e\u200b-\u200f\u2028-\u202e\u2060-\u206f"
                      "\ufeff\ufff9-\ufffb]")


def plain(text: object) -> str:
    """Text with its control characters shown as escapes (a newline as \\n, ESC as \\x1b): one line, inert."""
    text = str(text)
    return _CONTROL.sub(_escape_char, text) if _CONTROL.search(text) else text


def shortened(text: object, limit: int = NAME_LIMIT) -> str:
    """plain(text), at most `limit` characters (the rest as '...')."""
    text = plain(text)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def markup(text: object, limit: int | None = NAME_LIMIT) -> str:
    """A name for rich's console: inert (plain), markup escaped, shortened to `limit` characters (None: whole)."""
    return _rich_escape(plain(text) if limit is None else shortened(text, limit))


def md(text: object) -> str:
    """Text for a Markdown table cell or heading: inert (plain), `|` escaped."""
    return plain(text).replace("|", "\\|")
