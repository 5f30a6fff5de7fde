"""Fixed-width text tables for the commands (the ``tiermem bench`` tables): a :class:`Column`
a column (title, width in characters, alignment), the cells of a line joined by two spaces
(:func:`render`), and the cells those tables share: :func:`ratio` (the ``x`` column, a time
over the baseline's), :func:`spread` (the repeated runs' min-max, ms) and :data:`PARITY`
(the last column, each row's verdict against its baseline, never padded)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

GAP = "  "  # between two columns


@dataclass(frozen=True)
class Column:
    """One column: its ``title``, its ``width`` in characters (None: the widest of the title
    and the column's cells; a cell wider than a given width is printed whole and shifts the
    rest of its line; 0: no padding, for the last column) and ``align``, ``"<"`` (left) or
    ``">"`` (right).

    Raises:
        ValueError: ``align`` is neither ``"<"`` nor ``">"``, or ``width`` is negative.
    """

    title: str
    width: int | None = None
    align: str = ">"

    def __post_init__(self) -> None:
        if self.align not in ("<", ">"):
            raise ValueError(f"Column {self.title!r}: align={self.align!r} must be '<' (left) "
                             f"or '>' (right)")
        if self.width is not None and self.width < 0:
            raise ValueError(f"Column {self.title!r}: width={self.width} must be >= 0 "
                             f"(characters) or None (the widest cell)")

    def pad(self, cell: str, width: int) -> str:
        """``cell`` padded with spaces to ``width`` characters on the side ``align`` says."""
        return cell.ljust(width) if self.align == "<" else cell.rjust(width)


PARITY = Column("parity", 0, "<")


def render(columns: Sequence[Column], rows: Iterable[Sequence[str]]) -> str:
    """The table: a line of the columns' titles, then a line a row of ``rows`` (each row its
    cells as text, one a column), no trailing newline; no rows give the title line alone.

    Raises:
        ValueError: a row has not one cell a column.
    """
    rows = [list(r) for r in rows]
    for r in rows:
        if len(r) != len(columns):
            raise ValueError(f"table row {r!r} has {len(r)} cells for {len(columns)} columns "
                             f"({', '.join(c.title for c in columns)})")
    widths = [c.width if c.width is not None else max([len(c.title)] + [len(r[i]) for r in rows])
              for i, c in enumerate(columns)]
    lines = [[c.title for c in columns], *rows]
    return "\n".join(GAP.join(c.pad(cell, w) for c, cell, w in zip(columns, line, widths))
                     for line in lines)


def ratio(value: float, ref: float | None) -> str:
    """``value / ref`` with two decimals and an ``x`` (``"1.25x"``); ``"-"`` where there is no
    reference (None or 0)."""
    return f"{value / ref:.2f}x" if ref else "-"


def spread(lo_hi_ms: tuple[float, float]) -> str:
    """The runs' fastest and slowest ms as ``"12.3-14.0"`` (one decimal)."""
    lo, hi = lo_hi_ms
    return f"{lo:.1f}-{hi:.1f}"
