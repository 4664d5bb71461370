"""What the planner's table says of a layout as fast as the first choice."""

from parallax.plan.choice import Candidate
from parallax.plan.cost import StepTime
from parallax.plan.layout import Layout
from parallax.plan.report import why_slower


def _candidate(layout: Layout, seconds: float, gib: float) -> Candidate:
    time = StepTime(seconds, seconds, seconds, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    return Candidate(layout, (), gib * 2**30, 0.0, 8, time)


def test_a_tie_says_which_way_the_first_choice_differs():
    """The first choice can be the more involved layout of a tie when it fits a smaller cap
    (more memory must not choose slower): the simpler one then needs more memory, and says so."""
    zero1 = Layout(micro_batch_size=8, zero=1)
    offload = Layout(micro_batch_size=8, zero=2, offload=1.0)
    first = _candidate(offload, 1.000, 40.0)
    assert why_slower(_candidate(zero1, 1.001, 42.0), first) == "as fast (needs more GPU memory)"
    first = _candidate(zero1, 1.000, 42.0)
    assert why_slower(_candidate(offload, 1.001, 40.0), first) == "as fast (a more involved layout)"
    assert why_slower(_candidate(zero1, 1.001, 42.0), first) == "as fast"
