"""The one name rule, for snapshot names, tags, profile names and engine names, in the CLI and
the agent alike (a name one accepts, the other accepts): a letter or digit, then letters,
digits, ``.``, ``_`` or ``-``, at most 128 characters. A name is a single path component
(``run/NAME``, ``catalog/NAME/TAG/``) and a systemd instance name (``warmctl-up@NAME``), so it
never holds ``/``, never starts with ``.`` and is never ``..``."""

from __future__ import annotations

import re

#: The rule as a regular expression (also the agent API's ``pattern`` for names and tags).
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
NAME_RE = re.compile(NAME_PATTERN)
#: The rule in words, for error messages.
NAME_RULE = "a letter or digit, then letters, digits, '.', '_' or '-' (at most 128 characters)"


def check_name(what: str, value: str, error: type[Exception] = ValueError) -> str:
    """``value`` if it follows the rule, else raise ``error`` naming ``what`` and the rule."""
    if not isinstance(value, str) or not NAME_RE.fullmatch(value):  # fullmatch: `$` would pass "x\n"
        raise error(f"{what} {value!r}: want {NAME_RULE}")
    return value
