"""OpenVLA as a recipe: the first model family the one Trainer runs.

Blocks are ``["vision", "llm.0", ..., "head"]`` (:meth:`parallax.families.openvla.OpenVLA.
stage_blocks`); the first stage takes ``(pixel_values, input_ids)``, later ones the hidden
states ``(b, P + t, h)``. The objective (:mod:`parallax.families.openvla.objective`) is the
next-token cross-entropy summed over the labelled tokens (the 7 action tokens and EOS of each
sample), with OpenVLA's action-token accuracy and the L1 error of the decoded actions as
metrics. ``--action-head l1`` makes the run OpenVLA-OFT's (:mod:`parallax.families.openvla.oft`:
the same model with an L1 head, its own data side and objective).
"""

from __future__ import annotations

from parallax.families.openvla.config import OpenVLAConfig
from parallax.families.openvla.objective import ActionTokenObjective
from parallax.families.openvla.oft.objective import L1Objective
from parallax.families.openvla.oft.options import OFTOptions
from parallax.families.openvla.oft.sides import OFTData, OFTModel
from parallax.families.openvla.sides import OpenVLAData, OpenVLAModel
from parallax.recipe import Recipe


class OpenVLARecipe(Recipe):
    name = "openvla"
    options = OFTOptions

    def __init__(self) -> None:
        data = OpenVLAData()
        super().__init__(OpenVLAModel(data), data, ActionTokenObjective())

    def variant(self, options: OFTOptions, config: OpenVLAConfig) -> Recipe:
        """OpenVLA-OFT's recipe with ``--action-head l1``; an OFT model is refused without it."""
        if options.l1:
            return OFTRecipe()
        if config.oft is not None:
            raise ValueError(
                "--model is an OpenVLA-OFT model (an L1 action head): train it with "
                "--action-head l1"
            )
        return self


class OFTRecipe(OpenVLARecipe):
    """OpenVLA-OFT (``--action-head l1``): the same model with OFT's head, cameras and state, its
    data side and its L1 objective (:mod:`parallax.families.openvla.oft`)."""

    def __init__(self) -> None:
        data = OFTData()
        Recipe.__init__(self, OFTModel(data), data, L1Objective())

    def variant(self, options: OFTOptions, config: OpenVLAConfig) -> Recipe:
        return self
