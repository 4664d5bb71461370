"""LeRobot's processor files beside a policy folder: where its normalisation statistics live.

LeRobot (0.4+) saves a policy's two processor pipelines with ``save_pretrained``: a JSON per
pipeline (``policy_preprocessor.json``, ``policy_postprocessor.json``: ``{"name", "steps":
[{"registry_name", "config"[, "state_file"]}, ...]}``) and, for each step with a state, a
safetensors file named ``<pipeline>_step_<i>_<registry name>.safetensors``. The statistics are
the state of the ``normalizer_processor`` step (pi0: step 5, after the tokenizer; pi0.5: step
2, before the state is discretised) and of the postprocessor's ``unnormalizer_processor``
(step 0): flat keys ``<feature>.<stat>`` (``observation.state.mean``, ``action.q01``, ...).

Here they become the ``norm_stats`` entry :mod:`.batches` normalises by (``"action"`` and
``"proprio"``, lists of floats), and back: :func:`write_processors` starts from the folder the
model was read from (its JSON and every tensor kept, the action and state statistics replaced),
else writes the pipelines LeRobot's ``make_pi0_pre_post_processors`` /
``make_pi05_pre_post_processors`` build. float32 values survive the lists exactly, so a folder
read and written again is the same bytes.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from parallax.families.pi0.config import Pi0Config

PRE, POST = "policy_preprocessor", "policy_postprocessor"
NORMALIZER, UNNORMALIZER = "normalizer_processor", "unnormalizer_processor"
STATE, ACTION = "observation.state", "action"
OURS = {"action": ACTION, "proprio": STATE}  # norm_stats entry key -> LeRobot feature


def _step(pipeline: Mapping, registry_name: str) -> tuple[int, dict] | None:
    for i, step in enumerate(pipeline.get("steps", [])):
        if step.get("registry_name") == registry_name:
            return i, step
    return None


def read_pipelines(folder: str | Path) -> dict[str, Any] | None:
    """``{"pre": json, "post": json, "tensors": {file: {key: tensor}}}`` of a policy folder's
    processor files, or ``None`` when it has no ``policy_preprocessor.json``."""
    folder = Path(folder)
    if not (folder / f"{PRE}.json").is_file():
        return None
    out: dict[str, Any] = {"tensors": {}}
    for name, key in ((PRE, "pre"), (POST, "post")):
        path = folder / f"{name}.json"
        out[key] = json.loads(path.read_text()) if path.is_file() else None
        for step in (out[key] or {}).get("steps", []):
            if "state_file" in step:
                out["tensors"][step["state_file"]] = load_file(str(folder / step["state_file"]))
    return out


def entry_from_tensors(flat: Mapping[str, torch.Tensor]) -> dict[str, dict[str, list[float]]]:
    """Flat ``<feature>.<stat>`` tensors -> a ``norm_stats`` entry (``action``, ``proprio``)."""
    entry: dict[str, dict[str, list[float]]] = {}
    for ours, feature in OURS.items():
        stats = {
            key.rsplit(".", 1)[1]: [float(v) for v in t.float().reshape(-1)]
            for key, t in flat.items()
            if key.rsplit(".", 1)[0] == feature
        }
        if stats:
            entry[ours] = stats
    return entry


def read_statistics(folder: str | Path) -> dict[str, Any] | None:
    """The normalisation statistics of a policy folder's preprocessor (module doc), or
    ``None`` when it has no processor files (or its normalizer holds no statistics)."""
    pipelines = read_pipelines(folder)
    found = None if pipelines is None else _step(pipelines["pre"], NORMALIZER)
    if found is None or "state_file" not in found[1]:
        return None
    entry = entry_from_tensors(pipelines["tensors"][found[1]["state_file"]])
    return entry if "action" in entry else None


def _replaced(flat: Mapping[str, torch.Tensor], entry: Mapping, features) -> dict:
    """``flat`` with the action and state statistics of ``entry`` (float32, each the shape
    of the one it replaces when the sizes agree)."""
    out = dict(flat)
    for ours, feature in OURS.items():
        if feature not in features or ours not in entry:
            continue
        for stat, values in entry[ours].items():
            if stat == "mask":
                continue
            new = torch.tensor(values, dtype=torch.float32)  # (d,)
            old = out.get(f"{feature}.{stat}")
            if old is not None and old.numel() == new.numel():
                new = new.reshape(old.shape).to(old.dtype)
            out[f"{feature}.{stat}"] = new
    return out


def _features(config: Pi0Config, entry: Mapping) -> dict[str, dict]:
    size = config.vision.image_size
    raw = (config.lerobot or {}).get("input_features") or {
        f"observation.images.camera{i}": {"type": "VISUAL", "shape": [3, size, size]}
        for i in range(config.num_cameras)
    }
    out = {k: dict(v) for k, v in raw.items()}
    if "proprio" in entry:
        out.setdefault(STATE, {"type": "STATE", "shape": [len(entry["proprio"]["mean"])]})
    out[ACTION] = {"type": "ACTION", "shape": [len(entry["action"]["mean"])]}
    return out


def default_pipelines(config: Pi0Config, entry: Mapping) -> tuple[dict, dict]:
    """The pre- and postprocessor JSON LeRobot builds for pi0 / pi0.5 (module doc)."""
    mode = "QUANTILES" if config.pi05 else "MEAN_STD"
    norm_map = {"VISUAL": "IDENTITY", "STATE": mode, "ACTION": mode}
    features = _features(config, entry)
    normalizer = {"eps": 1e-08, "features": features, "norm_map": norm_map}
    unnormalizer = {**normalizer, "features": {ACTION: features[ACTION]}}
    tokenizer = {
        "max_length": config.text_length,
        "task_key": "task",
        "padding_side": "right",
        "padding": "max_length",
        "truncation": True,
        "tokenizer_name": "google/paligemma-3b-pt-224",
    }
    device = {"device": "cuda", "float_dtype": None}
    steps = [
        {"registry_name": "rename_observations_processor", "config": {"rename_map": {}}},
        {"registry_name": "to_batch_processor", "config": {}},
    ]
    norm = {"registry_name": NORMALIZER, "config": normalizer}
    if config.pi05:
        prepare = {"registry_name": "pi05_prepare_state_tokenizer_processor_step", "config": {}}
        steps += [norm, prepare]
    else:
        steps += [{"registry_name": "pi0_new_line_processor", "config": {}}]
    steps += [{"registry_name": "tokenizer_processor", "config": tokenizer}]
    steps += [{"registry_name": "device_processor", "config": device}]
    steps += [] if config.pi05 else [norm]
    post = [
        {"registry_name": UNNORMALIZER, "config": unnormalizer},
        {"registry_name": "device_processor", "config": {"device": "cpu", "float_dtype": None}},
    ]
    return {"name": PRE, "steps": steps}, {"name": POST, "steps": post}


def _write_pipeline(folder: Path, pipeline: dict, stateful: str, flat: dict, old: dict) -> None:
    """One pipeline's JSON and state files; the ``stateful`` step's state is ``flat``, other
    steps keep their own (``old``: file -> tensors)."""
    name = pipeline.get("name", PRE)
    for i, step in enumerate(pipeline["steps"]):
        if step.get("registry_name") == stateful:
            step["state_file"] = step.get("state_file") or f"{name}_step_{i}_{stateful}.safetensors"
            tensors = {k: v.contiguous() for k, v in flat.items()}
        elif "state_file" in step:
            tensors = old[step["state_file"]]
        else:
            continue
        save_file(tensors, str(folder / step["state_file"]))
    (folder / f"{name}.json").write_text(json.dumps(pipeline, indent=2))


def write_processors(folder: str | Path, config: Pi0Config, entry: Mapping) -> None:
    """Write the processor files of ``entry`` (a ``norm_stats`` entry) into a policy folder:
    on the files of the folder the model was read from when it has them, else LeRobot's
    default pipelines (module doc)."""
    folder = Path(folder)
    template = read_pipelines(config.source) if config.source else None
    if template is None or template["post"] is None:
        pre, post = default_pipelines(config, entry)
        old: dict[str, dict] = {}
        flats = {NORMALIZER: {}, UNNORMALIZER: {}}
    else:
        pre, post, old = template["pre"], template["post"], template["tensors"]
        flats = {}
        for pipeline, name in ((pre, NORMALIZER), (post, UNNORMALIZER)):
            found = _step(pipeline, name)
            state_file = None if found is None else found[1].get("state_file")
            flats[name] = dict(old[state_file]) if state_file else {}
    for pipeline, name in ((pre, NORMALIZER), (post, UNNORMALIZER)):
        found = _step(pipeline, name)
        features = (found[1].get("config") or {}).get("features", OURS.values()) if found else ()
        flat = _replaced(flats[name], entry, features)
        _write_pipeline(folder, pipeline, name, flat, old)
