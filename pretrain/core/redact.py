"""TODO docstring"""
from __future__ import annotations

import re

_URL = re.compile(r"(https?://)([^/\s?#@]*@)?([^\s?#]*)(\?[^\s#]*)?")


def redact(text: str) -> str:
    """`text` with the user info and the query values of every http(s) URL in it replaced by `***`."""
    def hide(m: re.Match) -> str:
        scheme, userinfo, rest, query = m.groups()
        if query:  # a value already hidden keeps what follows it (text after the URL): redact is idempotent
            query = "?" + "&".join(k + sep + (v if v.startswith("***") else "***" if sep else "")
                                   for k, sep, v in (p.partition("=") for p in query[1:].split("&")))
        return scheme + ("***@" if userinfo else "") + rest + (query or "")
    return _URL.sub(hide, text)
