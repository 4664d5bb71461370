"""OpenVLA-OFT's options: the OpenVLA family's own flags (``--action-head``, ``--action-chunk``,
``--film``), declared here and shown by ``--help`` under the family's group. Only the
declarations: importing this module imports no model code."""

from __future__ import annotations

from dataclasses import dataclass

from parallax.run.option import ONE, opt

ACTION_HEADS = ("tokens", "l1")
ACTIONS = "openvla: actions (OpenVLA-OFT)"
DEFAULT_CHUNK = 8  # OFT's LIBERO chunk


@dataclass(frozen=True)
class OFTOptions:
    """The action head and its chunk."""

    action_head: str = opt(
        "tokens",
        "tokens: OpenVLA's discrete action tokens, decoded one by one; l1: OpenVLA-OFT's "
        "parallel decoding (bidirectional attention, empty action slots) with an L1 regression "
        "head on action chunks, the wrist camera and proprio state as the data's key config "
        "gives them",
        ACTIONS,
        choices=ACTION_HEADS,
        params=True,
    )
    action_chunk: int | None = opt(
        None,
        "actions predicted per forward pass (the action dimension comes from the data)",
        ACTIONS,
        check=ONE,
        needs=("action_head", "l1"),
        default_text="8 with --action-head l1 (OFT's LIBERO chunk), else 1",
        params=True,
    )
    film: bool = opt(
        False,
        "FiLM every ViT block of both towers with the mean language embedding (OFT+)",
        ACTIONS,
        switch="on",
        needs=("action_head", "l1"),
        params=True,
    )

    @property
    def l1(self) -> bool:
        """Whether the run trains OFT's L1 head (``--action-head l1``)."""
        return self.action_head == "l1"

    @property
    def chunk(self) -> int:
        """``--action-chunk``, or OFT's LIBERO chunk."""
        return self.action_chunk or DEFAULT_CHUNK
