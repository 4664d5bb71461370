"""Old module paths, kept working for one release (until 0.2) as aliases of their new homes.

The families moved from ``parallax/models/`` and ``parallax/recipes/`` into
``parallax/families/<name>/``, and the recipe protocol and registry from ``parallax/train/``
into ``parallax/recipe/``. ``import parallax.models.openvla`` (say) still works: it gives the
new module, with a ``FutureWarning`` that names it. Nothing is imported until an old path is.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

MOVED = {
    "parallax.models.action_tokenizer": "parallax.families.openvla.action_tokenizer",
    "parallax.models.anyres": "parallax.families.llava_next.anyres",
    "parallax.models.config": "parallax.families.openvla.config",
    "parallax.models.contrastive": "parallax.families.siglip.step",
    "parallax.models.contrastive_eval": "parallax.families.siglip.retrieval",
    "parallax.models.hf": "parallax.families.openvla.checkpoint",
    "parallax.models.hf_save": "parallax.models.hf_export",
    "parallax.models.llava_config": "parallax.families.llava_next.config",
    "parallax.models.llava_flops": "parallax.families.llava_next.flops",
    "parallax.models.llava_hf": "parallax.families.llava_next.checkpoint",
    "parallax.models.llava_next": "parallax.families.llava_next.model",
    "parallax.models.llava_objectives": "parallax.families.llava_next.objectives",
    "parallax.models.llava_predict": "parallax.families.llava_next.predict",
    "parallax.models.llava_processor": "parallax.families.llava_next.processor",
    "parallax.models.llava_template": "parallax.families.llava_next.template",
    "parallax.models.llava_vision": "parallax.families.llava_next.vision",
    "parallax.models.llava_vocab": "parallax.families.llava_next.vocab",
    "parallax.models.objectives": "parallax.families.openvla.objectives",
    "parallax.models.openvla": "parallax.families.openvla.model",
    "parallax.models.openvla_flops": "parallax.families.openvla.flops",
    "parallax.models.predict": "parallax.families.openvla.predict",
    "parallax.models.preprocess": "parallax.families.openvla.preprocess",
    "parallax.models.siglip": "parallax.families.siglip.model",
    "parallax.models.siglip_config": "parallax.families.siglip.config",
    "parallax.models.siglip_hf": "parallax.families.siglip.checkpoint",
    "parallax.models.siglip_hf_config": "parallax.families.siglip.hf_config",
    "parallax.models.siglip_inputs": "parallax.families.siglip.inputs",
    "parallax.models.siglip_towers": "parallax.families.siglip.towers",
    "parallax.recipes.llava": "parallax.families.llava_next.recipe",
    "parallax.recipes.llava_batches": "parallax.families.llava_next.batches",
    "parallax.recipes.openvla": "parallax.families.openvla.recipe",
    "parallax.recipes.openvla_batches": "parallax.families.openvla.batches",
    "parallax.recipes.openvla_data": "parallax.families.openvla.data",
    "parallax.recipes.siglip": "parallax.families.siglip.recipe",
    "parallax.recipes.siglip_data": "parallax.families.siglip.data",
    "parallax.recipes.siglip_eval": "parallax.families.siglip.evaluate",
    "parallax.train.recipe": "parallax.recipe.protocol",
    "parallax.train.registry": "parallax.recipe.registry",
}

OLD_PACKAGE = "parallax.recipes"  # gone: its modules are in MOVED


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old path and loads it as the module at its new one."""

    def __init__(self) -> None:
        self._specs: dict = {}

    def find_spec(self, name, path, target=None):
        if name == OLD_PACKAGE:
            return importlib.util.spec_from_loader(name, self, is_package=True)
        if name not in MOVED:
            return None
        return importlib.util.spec_from_loader(name, self)

    def create_module(self, spec):
        if spec.name == OLD_PACKAGE:
            return None  # an empty package: its aliases' parent
        new = MOVED[spec.name]
        warnings.warn(
            f"{spec.name} moved to {new}; the old path goes in 0.2", FutureWarning, stacklevel=2
        )
        module = importlib.import_module(new)
        self._specs[spec.name] = module.__spec__  # the import system overwrites __spec__
        return module

    def exec_module(self, module) -> None:
        """The new module is already executed: give it its own spec back."""
        if module.__name__ == OLD_PACKAGE:
            return
        module.__spec__ = self._specs.pop(module.__spec__.name)


def install() -> None:
    """Put the alias finder first on ``sys.meta_path`` (once)."""
    if not any(isinstance(f, _Alias) for f in sys.meta_path):
        sys.meta_path.insert(0, _Alias())
