"""The recipe registry: families found by preset, checkpoint and prefix, a family that may
not take another's presets, each family's own presets, and an incomplete recipe refused."""

import json

import pytest

from parallax import Recipe, register
from parallax.recipe import (
    REQUIRED,
    DataSide,
    ModelSide,
    TokenObjective,
    missing_methods,
    registry,
)
from tests.recipe.toy_recipe import ToyRecipe


def test_registry_finds_families_by_preset_checkpoint_and_prefix(tmp_path):
    assert registry.find("tiny").name == "openvla"
    assert registry.find("openvla:tiny").name == "openvla"
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "openvla"}))
    assert registry.find(str(tmp_path)).name == "openvla"
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ValueError, match="model_type 'gpt2'"):
        registry.find(str(tmp_path))
    with pytest.raises(ValueError, match="neither a preset"):
        registry.find("no-such-model")
    registry.register("toy", ToyRecipe())
    try:
        assert registry.find("toy").name == "toy"
    finally:
        registry.FAMILIES.pop("toy")
        registry._LOADED.pop("toy")


def test_a_family_cannot_take_another_familys_presets():
    """A subclass of a built-in recipe inherits its presets: registered as they are, it would
    silently become what ``--model tiny`` means in this process (and in a test pool's worker
    processes, for every later test). It is refused, the registry left as it was; with
    presets of its own it runs as ``FAMILY:PRESET``."""

    class Shadow(type(registry.recipe("openvla"))):  # the built-in OpenVLARecipe
        name = "shadow"

    before = dict(registry.FAMILIES)
    for given in ({}, {"presets": ("mine", "small")}):
        with pytest.raises(ValueError, match="is family 'openvla''s already"):
            registry.register("shadow", Shadow(), **given)
        assert before == registry.FAMILIES and registry.find("tiny").name == "openvla"
    with pytest.raises(ValueError, match="register 'shadow' with presets of its own"):
        registry.register("shadow", "parallax.families.openvla.recipe:OpenVLARecipe", ("tiny",))
    registry.register("shadow", Shadow(), presets=())
    try:
        assert registry.find("tiny").name == "openvla"
        assert registry.find("shadow:tiny").name == "shadow"
        registry.register("shadow", Shadow(), presets=("shadow-tiny",))  # replacing itself
        assert registry.find("shadow-tiny").name == "shadow"
    finally:
        registry.FAMILIES.pop("shadow")
        registry._LOADED.pop("shadow")
    assert before == registry.FAMILIES


def test_the_registry_lists_each_familys_own_presets_and_every_recipe_is_complete():
    for name, family in registry.FAMILIES.items():
        recipe = registry.recipe(name)
        assert sorted(recipe.presets()) == sorted(family.presets), name
        assert missing_methods(recipe) == [], name


def test_an_incomplete_recipe_is_refused_when_registered():
    class HalfModel(ModelSide):
        def resolve(self, spec):
            raise NotImplementedError

    class Half(Recipe):
        name = "half"

        def __init__(self) -> None:
            super().__init__(HalfModel(), DataSide(), TokenObjective())

    missing = (
        "model.blocks, model.build, data.dataset, data.collator, data.stage_inputs, "
        "data.stage_metas, objective.loss_units, objective.loss_target, objective.loss"
    )
    with pytest.raises(TypeError, match=f"does not define {missing} "):
        register("half", Half())
    assert len(REQUIRED["model"] + REQUIRED["data"] + REQUIRED["tokens"]) == 10
