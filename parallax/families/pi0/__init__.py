"""pi0 and pi0.5: PaliGemma with a flow-matching action expert (``shared/pi0.md``, issue 38).

Files: ``config`` (presets, both variants), ``gemma`` (norms, MLP, one stream's half of a
layer), ``joint`` (the joint layer, the mask, the prefix cache), ``suffix`` (the expert's
tokens and the time), ``model``, ``objective`` (flow matching), ``predict`` (Euler sampling
over a cached prefix, ``load_policy``), ``prompt`` (prompts, the state bins, a built-in
tokenizer), ``checkpoint`` (LeRobot's policy folder), ``processors`` (its processor files:
the normalisation statistics), ``data`` (the synthetic task) and ``robot_data`` (LeRobot,
LIBERO and RLDS datasets).
"""

from parallax.families import lazy_exports

EXPORTS = {  # module -> the public names it defines
    "config": ("Pi0Config", "GemmaConfig"),
    "model": ("Pi0Model",),
    "predict": ("predict_action_chunk", "load_policy"),
}
__getattr__, __dir__, __all__ = lazy_exports(__name__, EXPORTS)
