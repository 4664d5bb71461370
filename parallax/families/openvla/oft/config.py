"""OpenVLA-OFT's options and the positions its head reads (``shared/oft.md``).

OFT ("Optimized Fine-Tuning", arXiv 2502.19645) keeps OpenVLA's towers, projector and Llama
and changes what is decoded: the prompt is followed by ``chunk x action_dim`` empty action
slots (their input embeddings multiplied by zero) and the stop token, attention is
bidirectional over the whole sequence with the padding's keys left out, and an MLP-ResNet
regresses the whole chunk at once from the final-norm hidden states one position before each
slot. Its inputs may add a wrist camera (1 to 3 images, each through both towers, the patch
sequences concatenated) and the robot's proprioceptive state (one token after the patches).

The multimodal sequence of a sample whose prompt has ``L`` token ids (BOS included) is::

    [BOS, patches of image 1 .. n, proprio?, prompt 1..L-1, slot 0..K*D-1, stop, padding]

so text index ``i >= 1`` sits at ``prefix + i`` with ``prefix = n * P + proprio`` (the
tokens inserted after BOS), slot ``j`` at ``prefix + L + j``, and the head reads position
``prefix + L - 1 + j``: the last prompt token, then slots ``0 .. K*D - 2``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

MAX_IMAGES = 3
HEAD_BLOCKS = 2  # OFT's MLP-ResNet has two residual blocks


@dataclass(frozen=True)
class OFTConfig:
    """What OFT adds to an OpenVLA: every field shapes parameters or the sequence.

    ``chunk``: actions per forward pass (OFT's ``NUM_ACTIONS_CHUNK``); ``action_dim`` and
    ``proprio_dim`` come from the data (0: no proprio token); ``num_images``: cameras per
    sample (1 to 3); ``film``: FiLM in every ViT block of both towers (OFT+).
    """

    chunk: int = 8
    action_dim: int = 7
    proprio_dim: int = 0
    num_images: int = 1
    film: bool = False
    head_blocks: int = HEAD_BLOCKS

    def __post_init__(self) -> None:
        problems = []
        if self.chunk < 1:
            problems.append(f"chunk {self.chunk} < 1")
        if self.action_dim < 1:
            problems.append(f"action_dim {self.action_dim} < 1")
        if self.proprio_dim < 0:
            problems.append(f"proprio_dim {self.proprio_dim} < 0")
        if not 1 <= self.num_images <= MAX_IMAGES:
            problems.append(f"num_images {self.num_images} outside 1..{MAX_IMAGES}")
        if self.head_blocks < 0:
            problems.append(f"head_blocks {self.head_blocks} < 0")
        if problems:
            raise ValueError("OFTConfig: " + "; ".join(problems))

    @property
    def slots(self) -> int:
        """Action slots in the sequence: ``chunk x action_dim``."""
        return self.chunk * self.action_dim

    @property
    def use_proprio(self) -> bool:
        return self.proprio_dim > 0

    def prefix(self, num_patches: int) -> int:
        """Tokens inserted after BOS: every image's patches and the proprio token."""
        return self.num_images * num_patches + int(self.use_proprio)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> OFTConfig:
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"parallax_oft: unknown keys {unknown}; known: {sorted(known)}")
        return cls(**d)


def first_inputs(oft: OFTConfig) -> tuple[str, ...]:
    """What the first stage of an OFT model takes, in order."""
    proprio = ("proprio",) if oft.use_proprio else ()
    return ("pixel_values", "input_ids", *proprio, "attention_mask", "action_mask")


def head_rows(prompt_lengths, seq_len: int, prefix: int, slots: int):
    """Rows of the flattened hidden states ``(b * seq_len, h)`` the head reads, sample-major
    then slot order: for sample ``i`` with a prompt of ``L_i`` ids, ``prefix + L_i - 1 + j``
    for ``j`` in ``0 .. slots - 1`` (a long tensor on the prompt lengths' device)."""
    lengths = torch.as_tensor(prompt_lengths, dtype=torch.long)  # (b,)
    b = lengths.shape[0]
    start = torch.arange(b, device=lengths.device) * seq_len + prefix + lengths - 1  # (b,)
    return (start[:, None] + torch.arange(slots, device=lengths.device)).reshape(-1)  # (b K D,)
