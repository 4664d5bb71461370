"""The flag reference in docs/training.md is generated from the option declarations and current:
a new option, a changed default or help text fails here until
``python -m parallax.train.reference docs/training.md`` is run."""

from pathlib import Path

from parallax.run import TrainConfig
from parallax.run.option import flag, options
from parallax.train.reference import main, reference

DOC = Path(__file__).parents[2] / "docs" / "training.md"


def test_the_flag_reference_is_current():
    assert main([str(DOC), "--check"]) == 0, "run: python -m parallax.train.reference " + str(DOC)


def test_every_shown_flag_is_in_the_reference():
    text = reference()
    for f, o in options(TrainConfig):
        if o.hidden:
            continue
        names = o.spellings if o.inverted else (flag(f.name),)
        assert all(f"`{n}" in text for n in names), f.name
