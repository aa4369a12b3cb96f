"""The ``vramgate`` commands (:mod:`serve_app.__main__` parses the command line): ``validate``
(:mod:`.validate`), ``plan`` (:mod:`.plan`) and ``profile`` (:mod:`.profile`), and what they
share: reading a ``serve run`` config (:mod:`.serve_config`) and the errors they print."""

from __future__ import annotations

import sys

from serve_app.config import ConfigError
from serve_app.memory.cost_model import TOKEN_AXES

EXIT_OK, EXIT_FAILED = 0, 1
"""Exit statuses: 0 done (for ``validate``: no problem found); 1 any error."""


class CliError(Exception):
    """A command cannot go on: each of ``lines`` is printed as one line (``vramgate: ...``,
    no traceback) and the exit status is 1.

    Args:
        lines: one problem each, e.g. ``configs/x.yaml: application 'a': args.x: ...``.
    """

    def __init__(self, *lines: str) -> None:
        self.lines = [one_line(line) for line in lines]
        super().__init__("; ".join(self.lines))


def one_line(text: str) -> str:
    """``text`` with every run of white space (newlines included) made one space."""
    return " ".join(str(text).split())


def config_problems(exc: ConfigError, where: str = "") -> list[str]:
    """The problems a :class:`~serve_app.config.ConfigError` lists (its lines below the
    ``invalid vramgate config:`` heading, e.g. ``args.admission.max_queu_len: unknown key``),
    each after ``where: `` when given."""
    heading, *lines = str(exc).split("\n")
    problems = [line.strip() for line in lines if line.strip()] or [heading]
    return [f"{where}: {p}" if where else p for p in problems]


def print_error(line: str) -> None:
    """Print one problem to stderr as one line: ``vramgate: <line>``."""
    print(f"vramgate: {one_line(line)}", file=sys.stderr, flush=True)


def print_warning(line: str) -> None:
    """Print one warning (not a problem: the exit status is unchanged) to stderr as one line:
    ``vramgate: warning: <line>``."""
    print(f"vramgate: warning: {one_line(line)}", file=sys.stderr, flush=True)


def shape_text(shape: tuple[int, int, int], axes: tuple[str, ...] = TOKEN_AXES) -> str:
    """A request shape in words: ``4 x 64 tokens + 32 new`` on the token axes, else each
    axis named (``files=1 audio_frames=6000 new_tokens=0``, ``Engine.shape_axes``)."""
    if tuple(axes) != TOKEN_AXES:
        return " ".join(f"{axis}={value}" for axis, value in zip(axes, shape, strict=True))
    batch, prompt, new = shape
    return f"{batch} x {prompt} tokens" + (f" + {new} new" if new else "")
