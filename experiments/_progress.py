"""Progress reporting shared by the long experiments.

``progress`` arguments accept ``True`` (a tqdm bar on stderr), ``False`` (silent) or a
callable ``(done, total) -> None`` so the dashboard can drive ``st.progress`` without this
package importing Streamlit.
"""

from __future__ import annotations

from typing import Callable, Optional, Union

from tqdm.auto import tqdm

ProgressArg = Union[bool, Callable[[int, int], None]]


class Progress:
    """Counts steps of one long computation and reports them the way ``progress`` asks.

    Example:
        >>> with Progress(False, total=3, desc="layers") as bar:
        ...     for _ in range(3):
        ...         bar.advance()
        >>> bar.done
        3
    """

    def __init__(self, progress: ProgressArg, total: int, desc: str = ""):
        if not (isinstance(progress, bool) or callable(progress)):
            from workbench.errors import InputError

            raise InputError(f"progress must be a bool or a callable (done, total) -> None, got {progress!r}")
        self.total = total
        self.done = 0
        self._callback: Optional[Callable[[int, int], None]] = progress if callable(progress) else None
        self._bar = tqdm(total=total, desc=desc, leave=False) if progress is True else None

    def advance(self, steps: int = 1) -> None:
        self.done += steps
        if self._bar is not None:
            self._bar.update(steps)
        if self._callback is not None:
            self._callback(self.done, self.total)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
