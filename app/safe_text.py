"""Text from a user or a link, made safe to show in a Streamlit message.

Every message box (``st.error``, ``st.warning``, ``st.info``, ``st.caption``, ``st.markdown``, ...)
renders markdown, so a value typed by the user or carried in a link could otherwise draw a link,
fetch an image or restyle the message. Backslash escapes are not enough: Streamlit turns a bare
URL into a link even when it is escaped. A markdown code span shows its content literally (no
links, images, emphasis or autolinks), so every such value goes into a message through ``quoted``.
"""

from __future__ import annotations

import re

MAX_QUOTED = 120  # longer values are cut: a message names the value, it does not reprint a page of it
_BACKTICKS = re.compile(r"`+")


def quoted(value: object, limit: int = MAX_QUOTED) -> str:
    """``value`` as a markdown code span shown literally: no markdown, link or image can come out of it.

    Line breaks and other unprintable characters are shown as escapes (a blank line would end the
    span), text past ``limit`` characters is cut with "…", and the fence is one backtick longer
    than any run of backticks inside, so the value cannot close it.

    Example:
        >>> quoted("nope [sign in](https://evil.example/phish)")
        '`nope [sign in](https://evil.example/phish)`'
        >>> quoted("a ``b`` c"), quoted("two\\n\\nlines"), quoted("x" * 200, limit=5)
        ('``` a ``b`` c ```', '`two\\\\n\\\\nlines`', '`xxxxx…`')
    """
    text = "".join(char if char.isprintable() else repr(char)[1:-1] for char in str(value))
    if len(text) > limit:
        text = text[:limit] + "…"
    fence = "`" * (max((len(run) for run in _BACKTICKS.findall(text)), default=0) + 1)
    # A space inside each fence when the text touches a backtick or a space (CommonMark strips one of each).
    pad = " " if text[:1] in ("`", " ") or text[-1:] in ("`", " ") or len(fence) > 1 else ""
    return f"{fence}{pad}{text}{pad}{fence}" if text else "` `"
