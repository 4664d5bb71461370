"""SigLIP and CLIP dual encoders as a recipe: a ``"step"`` objective whose loss sees the whole
global batch.

Presets ``siglip-tiny``, ``siglip-base-patch16-224``, ``siglip-large-patch16-256`` (sigmoid
loss) and ``clip-vit-large-patch14`` (and ``clip-tiny``; softmax loss), or a Hugging Face
``SiglipModel`` / ``CLIPModel`` checkpoint directory (found by its ``config.json``).

**Which negatives a step uses: all of them.** The loss of a step is the single-process
contrastive loss over the *global batch* (``--global-batch-size`` pairs: every dp rank's every
microbatch), each image against every caption of it. Across dp the losses of
:mod:`parallax.tensor.contrastive` exchange features (sigmoid: the chunked ring, memory
``O(local b^2)``; softmax: an all-gather with local rows); across microbatches
:func:`parallax.families.siglip.step.contrastive_step` caches the embeddings (GradCache): it
embeds every microbatch without autograd, takes the loss and its gradient with respect to
every embedding, then runs each microbatch's forward again and backpropagates its slice. So
gradient accumulation never shrinks the set of negatives; its price is one more forward per
microbatch when there are several (not counted in the FLOPs, like recomputation).

Layouts: tp shards both towers, dp with ZeRO-1 (``logit_scale`` and ``logit_bias`` are 1-element
parameters in the flat buffers); **pp > 1 is refused**: the towers are two parallel branches, not
a chain, and the largest preset (652M parameters) fits one GPU.

Metrics (:mod:`parallax.families.siglip.objective`): the temperature, the bias, the shares of
captions truncated and images resized; evaluation (``--eval-interval``): the loss, zero-shot
top-1/top-5 accuracy (one class-name prompt per class; the synthetic task's 18 colour-shape
classes, or 0 for data without labels) and image->text / text->image recall@1/5/10, where each
evaluation batch's ``--global-batch-size`` pairs are the candidates (the same pool the loss
contrasts), summed over ``--eval-batches``.
"""

from parallax.families.siglip.objective import ContrastiveObjective
from parallax.families.siglip.sides import SiglipData, SiglipModel
from parallax.recipe import Recipe


class SiglipRecipe(Recipe):
    name = "siglip"
    # options of robot data, of a language model's head and of fused projections
    unread = ("augment", "workers", "data_config", "logits", "fused_projections")

    def __init__(self) -> None:
        super().__init__(SiglipModel(), SiglipData(), ContrastiveObjective())
