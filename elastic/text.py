"""Text from the network or from workers made safe to print: one line, no terminal control sequences."""

from __future__ import annotations

import re

# C0 and C1 control characters and DEL; a newline would let a peer forge whole log lines, an escape
# sequence would let it rewrite the operator's terminal.
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def printable(text: str) -> str:
    """``text`` with every control character escaped (``\\n``, ``\\x1b``...): always a single line."""
    return _CONTROL.sub(lambda m: _NAMED.get(m.group(), f"\\x{ord(m.group()):02x}"), text)
