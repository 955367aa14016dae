"""Memory budgets: what a user writes (``"512MiB"``, ``"6GB"``, ``8 << 30``) and how it is printed."""

from __future__ import annotations

import re
from typing import Union

__all__ = ["parse_budget", "format_bytes"]

_UNITS = {
    "": 1, "B": 1,
    "KB": 10 ** 3, "MB": 10 ** 6, "GB": 10 ** 9, "TB": 10 ** 12,
    "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40,
}
_BUDGET = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([A-Za-z]*)\s*$")


def parse_budget(budget: Union[int, str]) -> int:
    """A budget in bytes from an ``int`` or a string with a unit (decimal ``KB/MB/GB/TB`` or
    binary ``KiB/MiB/GiB/TiB``; case-insensitive).

    Example::

        >>> parse_budget("512MiB"), parse_budget("6GB"), parse_budget(1 << 20)
        (536870912, 6000000000, 1048576)
    """
    if isinstance(budget, bool) or not isinstance(budget, (int, str)):
        raise TypeError(f"budget must be a number of bytes (int) or a string such as '512MiB' or '6GB', "
                        f"got {budget!r} ({type(budget).__name__})")
    if isinstance(budget, int):
        value = budget
    else:
        match = _BUDGET.match(budget)
        unit = match.group(2).upper() if match else None
        if match is None or unit not in _UNITS:
            raise ValueError(f"cannot read the budget {budget!r}: write a number of bytes with a unit, e.g. "
                             "'512MiB', '1.5GiB' or '6GB' (KB/MB/GB/TB are powers of 1000, KiB/MiB/GiB/TiB "
                             "powers of 1024)")
        value = int(float(match.group(1)) * _UNITS[unit])
    if value <= 0:
        raise ValueError(f"the budget must be positive, got {budget!r}")
    return value


def format_bytes(nbytes: float) -> str:
    """``nbytes`` in the largest binary unit that keeps it at or above 1 (``'37.5 MiB'``).

    Example::

        >>> format_bytes(37.5 * (1 << 20)), format_bytes(-2048)
        ('37.5 MiB', '-2.0 KiB')
    """
    sign, n = ("-" if nbytes < 0 else ""), abs(float(nbytes))
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{sign}{n / size:.1f} {unit}"
    return f"{sign}{n:.0f} B"
