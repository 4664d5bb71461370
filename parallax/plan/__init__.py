"""The planner: the fastest layout of a run that fits the GPUs at hand, predicted.

:mod:`~parallax.plan.memory` (what a rank holds, the one model ``--dry-run`` prints),
:mod:`~parallax.plan.cost` (a step's time), :mod:`~parallax.plan.search` (the layouts that fit,
fastest first; :mod:`~parallax.plan.ruled_out`: why none, when the flags leave none),
:mod:`~parallax.plan.machine` (profiles, measured by :mod:`~parallax.plan.calibrate`),
:mod:`~parallax.plan.auto` (``parallax.train --layout auto``) and the command line
:mod:`~parallax.plan.cli` (``python -m parallax.plan``; its flags: :mod:`~parallax.plan.options`).
"""
