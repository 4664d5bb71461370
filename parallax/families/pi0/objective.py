"""pi0's flow-matching objective (``shared/pi0.md``).

``t = 0.001 + 0.999 * Beta(1.5, 1)``, ``noise ~ N(0, I)``, ``x_t = t * noise + (1 - t) *
actions``, target velocity ``u = noise - actions``; the loss is the mean squared error between
the model's velocity and ``u`` over the real action dimensions (the padded ones are computed,
then cut) and the chunk's real steps. Beta(1.5, 1) has CDF ``x^1.5``, so it is drawn by
inversion, ``U^(2/3)``, from a generator the caller may give. Noise and times may be given (a
test fixes them).

**Padded chunk steps** (``action_pad``, LeRobot's ``action_is_pad``): a robot sample near an
episode's end repeats the last action past the end (:mod:`.robot_data`); those slots are left
out of the loss and of its unit count, so the mean is over the real ``(step, dim)`` elements
of the global batch whatever the layout. LeRobot itself, as its source reads
(``src/lerobot/policies/pi0/modeling_pi0.py`` and ``pi05/modeling_pi05.py`` on its main
branch): the policies apply no pad mask at all (``losses[:, :, :D].mean()`` over every
element, the repeated last action included). Its first port (``lerobot/common/policies/pi0``,
as forks keep it) multiplied the per-element losses by ``~actions_is_pad`` and then took
``.mean()`` over all ``b x H x D`` elements, the masked zeros in the denominator, but read the
mask under the key ``"actions_id_pad"``, which no dataset gives, so it never applied. Here the
mask applies and the denominator counts only the real elements (a sample without
``action_pad``, the synthetic task's, has none padded).

In the trainer the loss of a microbatch is the *sum* of squared errors over its real elements
(at most ``b x H x D``), the units the trainer divides the global batch's sum by
(:class:`FlowMatchingObjective`). Its evaluation also samples every held-out chunk
(:func:`~.predict.sample_chunk`, the sample's own noise, the config's Euler steps) and reports
the mean squared error of the chunk (``eval_chunk_mse``) beside that of always predicting the
data's mean action (``eval_mean_action_mse``), both per action element in the normalised
space: the flow-matching loss alone cannot tell a policy that reads the scene from one that
learned the actions' marginal distribution.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from parallax.families.pi0.sampling import sample_chunk
from parallax.recipe import TokenObjective
from parallax.recipe.objective import MetricSpec

# what a microbatch gives the model, in the order of Pi0Model.velocity's first arguments
MODEL_INPUTS = ("images", "image_masks", "tokens", "token_mask", "state")
PREFIX_INPUTS = MODEL_INPUTS[:4]


def sample_time(b: int, generator: torch.Generator | None = None, device=None) -> torch.Tensor:
    """``(b,)`` flow-matching times: ``0.001 + 0.999 * Beta(1.5, 1)``."""
    u = torch.rand(b, generator=generator, device=device, dtype=torch.float64)
    return (0.001 + 0.999 * u.pow(2.0 / 3.0)).float()


def sample_noise(actions: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """``N(0, I)`` of the padded actions' shape ``(b, H, A)``, float32."""
    return torch.randn(
        actions.shape, generator=generator, device=actions.device, dtype=torch.float32
    )


@dataclass
class FlowMatching:
    """One microbatch's flow-matching terms: the noisy actions the model reads and the target."""

    x_t: torch.Tensor  # (b, H, A)
    target: torch.Tensor  # (b, H, A): noise - actions
    time: torch.Tensor  # (b,)


def flow_terms(actions: torch.Tensor, noise: torch.Tensor, time: torch.Tensor) -> FlowMatching:
    """``x_t`` and ``u`` of padded ``actions`` (b, H, A) at ``noise`` and ``time`` (b,)."""
    actions, noise, t = actions.float(), noise.float(), time.float()[:, None, None]
    return FlowMatching(t * noise + (1 - t) * actions, noise - actions, time.float())


def squared_error_sum(velocity, target, action_dim: int, pad=None) -> torch.Tensor:
    """Sum of squared errors over the first ``action_dim`` (real) dimensions and the steps
    ``pad`` (b, H) does not flag."""
    err = (velocity.float() - target)[..., :action_dim] ** 2  # (b, H, D)
    if pad is not None:
        err = err.masked_fill(pad.to(err.device)[..., None], 0.0)  # (b, H, D)
    return err.sum()


def real_steps(mb: Mapping) -> torch.Tensor:
    """``(b, H)`` bool: the chunk steps inside their episode (all of them without a mask)."""
    pad = mb.get("action_pad")
    if pad is None:
        return torch.ones(mb["actions"].shape[:2], dtype=torch.bool)
    return ~pad.bool()


def flow_matching_loss(
    model, mb: Mapping, noise=None, time=None, generator: torch.Generator | None = None
) -> torch.Tensor:
    """The mean squared error of one batch (``mb``: the collated tensors of
    :mod:`.batches`, on the model's device), with given or drawn ``noise`` and ``time``."""
    actions = mb["actions"]  # (b, H, A)
    noise = sample_noise(actions, generator) if noise is None else noise
    time = sample_time(actions.shape[0], generator, actions.device) if time is None else time
    terms = flow_terms(actions, noise, time)
    v = model.velocity(*(mb.get(k) for k in MODEL_INPUTS), terms.x_t, terms.time)
    d, pad = int(mb["action_dim"]), mb.get("action_pad")
    total = squared_error_sum(v, terms.target, d, pad)
    return total / (int(real_steps(mb).sum()) * d)


class FlowMatchingObjective(TokenObjective):
    """The trainer's side: units the real elements (``b x H x D`` less the padded steps');
    noise and times come with the microbatch (drawn on the host by the collator from the run's
    seed and each sample's key, so every layout draws the same)."""

    def loss_units(self, mb: Mapping) -> int:
        return int(real_steps(mb).sum()) * int(mb["action_dim"])

    def loss_target(self, run, mb: Mapping):
        terms = flow_terms(mb["actions"], mb["noise"], mb["time"])
        return terms.target, int(mb["action_dim"]), ~real_steps(mb)

    def loss(self, chunk, output, target, ctx, run):
        goal, d, pad = target
        total = squared_error_sum(output, goal.to(output.device), d, pad)
        return total, torch.zeros(0, device=output.device)

    eval_metric_sums = ("chunk_se", "mean_action_se", "elements")
    eval_metrics = (
        MetricSpec("chunk_mse", "chunk_se", "elements", "chunk mse", ".4f"),
        MetricSpec("mean_action_mse", "mean_action_se", "elements", "mean-action mse", ".4f"),
    )

    def sampled_sums(self, chunks, microbatches, ctx, run) -> torch.Tensor:
        """Squared errors of the sampled chunks and of the mean action, and their element
        count, over the real elements (module doc); NaN where a rank holds several pipeline
        chunks (an interleaved schedule, which the staged sampler does not walk)."""
        sums = torch.zeros(3, dtype=torch.float64)
        if len(chunks) != 1:
            sums[:2] = float("nan")
            return sums
        model, device = chunks[0], ctx.device
        for mb in microbatches:
            prefix = [mb[k].to(device) for k in PREFIX_INPUTS]
            state = None if model.config.pi05 else mb["state"].to(device)
            chunk = sample_chunk(model, *prefix, state, mb["noise"].to(device)).cpu()
            d = int(mb["action_dim"])
            actions = mb["actions"][..., :d].double()  # (b, H, D)
            mean = mb["mean_action"][:, None, :d].double()  # (b, 1, D)
            keep = real_steps(mb)[..., None].double()  # (b, H, 1)
            sums[0] += (((chunk[..., :d].double() - actions) ** 2) * keep).sum()
            sums[1] += (((mean - actions) ** 2) * keep).sum()
            sums[2] += keep.sum() * d
        return sums
