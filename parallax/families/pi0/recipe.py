"""pi0 and pi0.5 as a recipe: presets ``pi0``, ``pi05``, ``pi0-tiny``, ``pi05-tiny`` or a
LeRobot policy folder (found by its ``config.json``'s ``type``).

The objective is flow matching (:mod:`.objective`): per microbatch the sum of squared velocity
errors over the real action dimensions and chunk steps, divided by the global batch's count of
them; the noise and the times come with the microbatch (:mod:`.batches`).
"""

from parallax.families.pi0.objective import FlowMatchingObjective
from parallax.families.pi0.options import Pi0Options
from parallax.families.pi0.sides import Pi0Data, Pi0Side
from parallax.recipe import Recipe


class Pi0Recipe(Recipe):
    name = "pi0"
    options = Pi0Options
    # OpenVLA's image augmentation and options of a language model's head (pi0's robot data
    # streams with --workers, unaugmented)
    unread = ("augment", "logits", "fused_projections")

    def __init__(self) -> None:
        super().__init__(Pi0Side(), Pi0Data(), FlowMatchingObjective())
