"""LLaVA-NeXT (LLaVA-v1.6) as a recipe: the second vision-language family of the one Trainer.

Blocks are ``["vision", "llm.0", ..., "head"]`` (:meth:`parallax.models.LlavaNext.stage_blocks`):
the first stage takes ``(pixel_values, input_ids, image_sizes)``, every later one the hidden
states ``(b, t, h)`` of its microbatch, whose ``t`` (text plus image tokens of the longest
sample) differs from one microbatch to the next. Samples are right-padded; attention is causal,
so every real token precedes the padding and never attends to it: the padded activations are
all that travels between stages (no mask), and the padding carries no label. The loader groups
samples of similar length (:class:`~parallax.data.LengthGroupedLoader`, LLaVA's modality-length
sampler), and the loss of every microbatch is its sum over supervised tokens divided by the
supervised tokens of the whole global batch (the Trainer counts them over dp), so every layout
and every grouping gives the same update.

Defaults as LLaVA-v1.6 fine-tunes: peak learning rate 2e-5 for the projector and the language
model and a tenth of it for the CLIP tower (``--lr-groups "vision_tower.*=LR/10"`` unless
``--lr-groups`` is given; ``--lr-groups ""`` trains everything at ``--lr``). Stage 1 (the
projector only) is ``--freeze vision,llm``. Metrics are the teacher-forced answer accuracy (every
supervised token of a sample right) and token accuracy.
"""

from parallax.families.llava_next.objective import AnswerObjective
from parallax.families.llava_next.sides import LlavaData, LlavaModel
from parallax.recipe import Recipe


class LlavaRecipe(Recipe):
    name = "llava"
    unread = ("augment", "workers", "data_config")  # options of robot data

    def __init__(self) -> None:
        super().__init__(LlavaModel(), LlavaData(), AnswerObjective())
