"""Model families, one package each: OpenVLA, LLaVA-NeXT, SigLIP/CLIP dual encoders.

A family package holds everything about its models: config and presets, the model, the
checkpoint layout (read and write), tokenizer and processor, objectives, FLOPs, the recipe the
one Trainer runs, and the code that turns samples into microbatches. Nothing here imports a
family: the registry (:mod:`parallax.recipe.registry`) imports one when a run asks for it.
"""
