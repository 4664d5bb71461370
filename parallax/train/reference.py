"""The flag reference of ``docs/training.md``, generated from the option declarations.

``python -m parallax.train.reference docs/training.md`` rewrites the block between the
``<!-- flags:begin -->`` and ``<!-- flags:end -->`` markers; ``--check`` only says whether it
is current (a test runs that, so the reference cannot go stale).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from parallax.recipe import flags

BEGIN, END = "<!-- flags:begin -->", "<!-- flags:end -->"


def reference() -> str:
    """Every flag, a table per ``--help`` group."""
    intro = (
        "Generated from the option declarations (`parallax/run/options_*.py`, and each "
        "family's own, such as `parallax/families/openvla/oft/options.py`) by "
        "`python -m parallax.train.reference docs/training.md`; every flag is also a key of a "
        "`--config` TOML file (`global-batch-size = 64` or `global_batch_size`).\n\n"
    )
    return intro + flags.reference()


def with_reference(text: str, where: str = "the file") -> str:
    """``text`` with the block between the markers replaced by :func:`reference`."""
    if BEGIN not in text or END not in text:
        raise ValueError(f"{where} has no {BEGIN} ... {END} block to fill")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{reference()}{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="parallax.train.reference", description=__doc__)
    p.add_argument("file", type=Path, help="the Markdown file holding the markers")
    p.add_argument("--check", action="store_true", help="only check that it is current")
    args = p.parse_args(argv)
    text = args.file.read_text()
    new = with_reference(text, str(args.file))
    if args.check:
        if new != text:
            print(f"{args.file}: the flag reference is stale; run {p.prog} {args.file}")
            return 1
        return 0
    args.file.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
