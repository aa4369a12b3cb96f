"""The check's rows and the one table they are printed as.

Each row is one figure of one scenario under one allocator setting, with its verdict:
``pass`` or ``FAIL`` for a figure checked against a bound (the bound is written in the
value), ``info`` for a figure shown but not checked (e.g. host-RSS peaks on CPU, which are too
noisy to bound). The table puts the settings side by side: one value column per setting.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path

MiB, GiB = 1 << 20, 1 << 30


@dataclass(frozen=True)
class Row:
    """One figure of one scenario (``setting``: the allocator setting it ran under)."""

    scenario: str
    figure: str
    value: str
    status: str  # "pass", "FAIL" or "info"
    setting: str = ""

    @property
    def failed(self) -> bool:
        return self.status == "FAIL"


def check(scenario: str, figure: str, value: str, ok: bool) -> Row:
    """A checked figure: ``pass`` when ``ok``."""
    return Row(scenario, figure, value, "pass" if ok else "FAIL")


def info(scenario: str, figure: str, value: str) -> Row:
    """A figure shown, not checked."""
    return Row(scenario, figure, value, "info")


def under(setting: str, rows: list[Row]) -> list[Row]:
    """``rows`` marked with the allocator setting they ran under."""
    return [replace(row, setting=setting) for row in rows]


def mib(nbytes: float) -> str:
    """Bytes in MiB, or in GiB from 1 GiB up."""
    if abs(nbytes) >= GiB:
        return f"{nbytes / GiB:,.2f} GiB"
    return f"{nbytes / MiB:,.1f} MiB"


def share(fraction: float) -> str:
    """A fraction as a percentage, or in scientific notation below 0.1 %."""
    return f"{fraction:.1%}" if fraction == 0 or fraction >= 1e-3 else f"{fraction:.0e}"


def _verdict(statuses: list[str]) -> str:
    if "FAIL" in statuses:
        return "FAIL"
    return "pass" if "pass" in statuses else "info"


def table(rows: list[Row]) -> str:
    """``scenario | figure | <value under each setting> | result``, one line per figure
    (in the order first seen), columns padded to their widest cell; ``result`` is FAIL if
    any setting failed it."""
    settings = list(dict.fromkeys(row.setting for row in rows))
    figures: dict[tuple[str, str], dict[str, Row]] = {}
    for row in rows:
        figures.setdefault((row.scenario, row.figure), {})[row.setting] = row
    header = ["scenario", "figure", *(s or "value" for s in settings), "result"]
    if len(settings) == 1:
        header[2] = "value"
    cells = [header] + [
        [scenario, figure, *(by[s].value if s in by else "-" for s in settings),
         _verdict([r.status for r in by.values()])]
        for (scenario, figure), by in figures.items()]
    widths = [max(len(line[i]) for line in cells) for i in range(len(header))]
    lines = [" | ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip()
             for line in cells]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)


def save_rows(rows: list[Row], path: Path) -> None:
    path.write_text(json.dumps([asdict(r) for r in rows], indent=1) + "\n")


def load_rows(path: Path) -> list[Row]:
    return [Row(**raw) for raw in json.loads(path.read_text())]
