"""Text on figures that must stay readable: point names placed where they hide neither each other
nor a marker, and long titles wrapped between words instead of cut."""
from __future__ import annotations

import textwrap
from typing import Sequence

# Plotly's default label font (12 px): about 7 px a character, 14 px a line; markers 13 px wide.
CHAR_PX, LINE_PX, MARKER_PX = 7.0, 14.0, 13.0
# textposition -> where the label's box centre sits from its marker, in units of (box width / 2 +
# marker radius, box height / 2 + marker radius); the first fitting one is taken, in this order.
POSITIONS = {"top center": (0, 1), "bottom center": (0, -1), "middle right": (1, 0), "middle left": (-1, 0),
             "top right": (1, 1), "top left": (-1, 1), "bottom right": (1, -1), "bottom left": (-1, -1)}


def _overlap(a, b) -> float:
    """Area shared by two boxes (x0, y0, x1, y1)."""
    w = min(a[2], b[2]) - max(a[0], b[0])
    h = min(a[3], b[3]) - max(a[1], b[1])
    return w * h if w > 0 and h > 0 else 0.0


def place_labels(points: Sequence[tuple[str, float, float]], px_per_unit: float,
                 prefer: Sequence[str] = ()) -> list[str]:
    """A textposition per (label, x, y): each label's box clear of every marker and of the labels
    placed before it where some position allows, else where it overlaps least. ``prefer``: each
    point's first choice ("bottom center" for merges near the base); the others follow POSITIONS."""
    r = MARKER_PX / 2
    at = [(x * px_per_unit, y * px_per_unit) for _, x, y in points]
    markers = [(px - r, py - r, px + r, py + r) for px, py in at]
    placed, out = [], []
    for i, (label, _, _) in enumerate(points):
        w, h = CHAR_PX * len(label) / 2, LINE_PX / 2
        order = ([prefer[i]] if i < len(prefer) and prefer[i] else []) + list(POSITIONS)
        best, best_cost = order[0], None
        for pos in dict.fromkeys(order):
            dx, dy = POSITIONS[pos]
            cx, cy = at[i][0] + dx * (w + r), at[i][1] + dy * (h + r)
            box = (cx - w, cy - h, cx + w, cy + h)
            cost = sum(_overlap(box, m) for m in markers) + sum(_overlap(box, p) for p in placed)
            if best_cost is None or cost < best_cost:
                best, best_cost, best_box = pos, cost, box
            if cost == 0:
                break
        placed.append(best_box)
        out.append(best)
    return out


def wrapped(text: str, width: int = 72, lines: int = 3) -> str:
    """Plotly neither wraps nor cuts a title: the text broken between words into lines of at most
    ``width`` characters (a word longer stays whole), joined by <br>; past ``lines`` lines, the
    rest is counted, never cut mid-word ("task_ari…")."""
    rows = textwrap.wrap(text, width, break_long_words=False, break_on_hyphens=False) or [""]
    if len(rows) <= lines:
        return "<br>".join(rows)
    rest = len(" ".join(rows[lines:]).split())
    return "<br>".join(rows[:lines]) + f" … ({rest} more word{'s' if rest != 1 else ''})"
