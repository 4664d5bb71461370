"""parallax: hybrid dp x tp x pp training on raw torch.distributed."""

from parallax.context import ParallelContext, init_parallel
from parallax.dims import ParallelDims
from parallax.init import init_parameters, param_seed
from parallax.recipe import Recipe, register

__version__ = "0.1.0"

__all__ = [
    "ParallelContext",
    "ParallelDims",
    "Recipe",
    "init_parallel",
    "init_parameters",
    "param_seed",
    "register",
]
