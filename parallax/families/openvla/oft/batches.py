"""Raw robot samples -> the tensors OpenVLA-OFT trains on (``--action-head l1``).

A sample holds its camera images (``image``, then ``wrist_image``, then ``wrist_image_2``:
as many as the model takes), the instruction, the chunk of the next ``K`` actions
``actions`` ``(K, D)`` (the data side cuts it: :mod:`parallax.data.source`) and, with a
proprio token, the robot state ``state``. As OFT's ``RLDSBatchTransform``: actions and state
are normalised to [-1, 1] with the dataset's q01/q99 (actions only where the mask says, as
OpenVLA's gripper; dimensions whose min equals max become 0), the instruction is lower-cased
into OpenVLA's prompt, and the prompt is followed by ``K x D`` action slots and the stop token.
The slots' ids do not matter (their embeddings are zeroed): the pad id fills them. Sequences
are right-padded; ``attention_mask`` marks the real tokens, ``action_mask`` the slots, and
``prompt_lengths`` says where each sample's slots start (the head's rows, found on the host).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from parallax.families.openvla.action_tokenizer import normalize_actions
from parallax.families.openvla.batches import padded_width
from parallax.families.openvla.config import OpenVLAConfig
from parallax.families.openvla.preprocess import pixel_values
from parallax.families.openvla.prompt import prompt_ids

CAMERAS = ("image", "wrist_image", "wrist_image_2")


def oft_prompt(tokenizer, instruction: str, slots: int, pad_id: int) -> tuple[list[int], int]:
    """``(input_ids, prompt length)``: ``[bos] prompt ▁`` then ``slots`` placeholders and EOS,
    the sequence OFT trains and predicts on."""
    ids = prompt_ids(tokenizer, instruction.lower())
    return ids + [pad_id] * slots + [tokenizer.eos_id], len(ids)


def sample_images(sample: Mapping, num_images: int) -> list:
    """The sample's first ``num_images`` cameras, in :data:`CAMERAS` order."""
    missing = [k for k in CAMERAS[:num_images] if k not in sample]
    if missing:
        raise ValueError(
            f"the model takes {num_images} images per sample but a sample of "
            f"{sample.get('dataset', 'the dataset')!r} lacks {', '.join(missing)}"
        )
    return [sample[k] for k in CAMERAS[:num_images]]


def oft_pixel_values(images: Sequence, config: OpenVLAConfig) -> torch.Tensor:
    """One sample's images -> ``(6 n, S, S)``: six channels (both towers' normalisations) per
    image, image after image, as OFT stacks them."""
    return torch.cat([pixel_values(image, config)[0] for image in images], dim=0)


def normalized_proprio(state, stats: Mapping) -> np.ndarray:
    """The robot state normalised as OFT's data pipeline does (q01/q99 on every dimension)."""
    if "proprio" not in stats:
        raise ValueError("the dataset statistics have no proprio entry: no state to normalise")
    return normalize_actions(np.asarray(state, dtype=np.float64), stats["proprio"])


class OFTBatchBuilder:
    """Lists of raw samples -> ``{"pixel_values", "input_ids", "attention_mask",
    "action_mask", "prompt_lengths", "actions"(, "proprio")}`` (see the module doc).
    ``stats``: one dataset's ``norm_stats`` or a mixture's (a sample uses its ``dataset``'s)."""

    def __init__(self, config: OpenVLAConfig, stats: Mapping, tokenizer) -> None:
        if config.oft is None:
            raise ValueError("OFTBatchBuilder needs a model config with OFT options")
        if not stats:
            raise ValueError("expected the statistics of at least one dataset, got none")
        self.config, self.oft, self.tokenizer = config, config.oft, tokenizer
        self.stats = dict(stats)
        for name, entry in self.stats.items():
            dim = len(entry["action"]["q01"])
            if dim != self.oft.action_dim:
                raise ValueError(
                    f"dataset {name!r} has {dim}-dimensional actions, the model's head "
                    f"predicts {self.oft.action_dim}"
                )

    def stats_of(self, sample: Mapping) -> Mapping:
        if len(self.stats) == 1:
            return next(iter(self.stats.values()))
        name = sample.get("dataset")
        if name not in self.stats:
            raise ValueError(f"a sample of dataset {name!r} but statistics of {sorted(self.stats)}")
        return self.stats[name]

    def actions(self, sample: Mapping, stats: Mapping) -> np.ndarray:
        """The sample's normalised chunk ``(K, D)``."""
        k, d = self.oft.chunk, self.oft.action_dim
        raw = sample.get("actions")
        if raw is None and k == 1 and "action" in sample:
            raw = np.asarray(sample["action"])[None]
        raw = None if raw is None else np.asarray(raw, dtype=np.float64)
        if raw is None or raw.shape != (k, d):
            shape = None if raw is None else raw.shape
            raise ValueError(
                f"{sample.get('dataset', 'the dataset')!r}: an action chunk of shape {shape}, "
                f"the model predicts chunks of ({k}, {d}) (--action-chunk {k})"
            )
        return normalize_actions(raw, stats["action"])

    def __call__(self, samples: Sequence[Mapping]) -> dict[str, torch.Tensor]:
        oft, pad = self.oft, self.config.pad_token_id
        ids, lengths, actions, proprio, images = [], [], [], [], []
        for s in samples:
            stats = self.stats_of(s)
            i, n = oft_prompt(self.tokenizer, s["instruction"], oft.slots, pad)
            ids.append(i)
            lengths.append(n)
            actions.append(self.actions(s, stats))
            if oft.use_proprio:
                state = normalized_proprio(s["state"], stats)
                if state.shape != (oft.proprio_dim,):
                    raise ValueError(
                        f"a state of shape {state.shape}, the model's proprio projector takes "
                        f"{oft.proprio_dim} dimensions"
                    )
                proprio.append(state)
            images.append(oft_pixel_values(sample_images(s, oft.num_images), self.config))
        out = {
            "pixel_values": torch.stack(images),  # (b, 6 n, S, S)
            **padded_prompts(ids, lengths, oft.slots, pad, self.config.text_multiple),
            "actions": torch.tensor(np.stack(actions), dtype=torch.float32),  # (b, K, D)
        }
        if oft.use_proprio:
            out["proprio"] = torch.tensor(np.stack(proprio), dtype=torch.float32)  # (b, P)
        return out


def padded_prompts(
    ids: Sequence[Sequence[int]], lengths: Sequence[int], slots: int, pad: int, multiple: int = 1
) -> dict[str, torch.Tensor]:
    """Right-padded ``input_ids``, ``attention_mask``, ``action_mask`` ``(b, t)`` and
    ``prompt_lengths`` ``(b,)`` of sequences from :func:`oft_prompt` (training and inference
    pad alike, so a sample's forward is the same in both)."""
    width = padded_width(max(len(i) for i in ids), multiple)
    b = len(ids)
    input_ids = torch.full((b, width), pad, dtype=torch.long)  # (b, t)
    attention = torch.zeros((b, width), dtype=torch.bool)  # (b, t)
    action_mask = torch.zeros((b, width), dtype=torch.bool)  # (b, t)
    for row, (i, n) in enumerate(zip(ids, lengths)):
        input_ids[row, : len(i)] = torch.tensor(i)
        attention[row, : len(i)] = True
        action_mask[row, n : n + slots] = True
    return {
        "input_ids": input_ids,
        "attention_mask": attention,
        "action_mask": action_mask,
        "prompt_lengths": torch.tensor(lengths, dtype=torch.long),  # (b,)
    }


def stage_inputs(config: OpenVLAConfig, mb: Mapping) -> tuple[torch.Tensor, ...]:
    """What an OFT model's first stage takes from a microbatch, in order."""
    proprio = (mb["proprio"],) if config.oft.use_proprio else ()
    return (mb["pixel_values"], mb["input_ids"], *proprio, mb["attention_mask"], mb["action_mask"])
