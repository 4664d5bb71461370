"""``predict_action_chunk``: one forward pass gives the chunk the training forward gives at the
same positions; the same actions at tp 1, tp 2 and pp 2; a run's checkpoint and its export
(the HF layout, the OFT modules as safetensors and in OFT's own ``.pt`` files) reload into
parallax and give them again."""

import dataclasses
import json

import numpy as np
import pytest
import torch

from parallax.families.openvla.action_tokenizer import unnormalize_actions
from parallax.families.openvla.model import OpenVLA
from parallax.families.openvla.oft.config import OFTConfig, head_rows
from parallax.families.openvla.oft.predict import predict_action_chunk
from parallax.testing import context, run_ranks
from tests.families.openvla.helpers import SEED, perturbed_init, tiny_config
from tests.families.openvla.test_oft_reference import _batch, _samples, _stats

OFT = OFTConfig(chunk=2, action_dim=7, proprio_dim=3, num_images=2, film=True)


def close(got, want, msg: str = "") -> None:
    """Within 1e-5 of the actions' scale (float32 sums in another order)."""
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max(), err_msg=msg)


def _config():
    cfg = dataclasses.replace(tiny_config(), oft=OFT)
    return dataclasses.replace(cfg, norm_stats=_stats(cfg))


def _model(ctx=None):
    model = OpenVLA(_config(), ctx)
    model.init_weights(SEED, perturbed_init)
    return model


def _predict(model, sample) -> np.ndarray:
    images = [sample["image"], sample["wrist_image"]]
    return model.predict_action_chunk(images, sample["instruction"], sample["state"])


def test_one_forward_is_the_training_forward():
    from parallax.families.openvla.oft.batches import stage_inputs

    model = _model()
    samples = _samples(model.config)
    mb = _batch(model.config, samples)  # the training batch: two samples, one padded
    model.return_hidden = True
    with torch.no_grad():
        hidden = model(*stage_inputs(model.config, mb))
        cfg = model.config
        rows = head_rows(mb["prompt_lengths"], hidden.shape[1], cfg.prefix_tokens, cfg.oft.slots)
        trained = model.oft_actions(hidden.flatten(0, 1)[rows]).numpy()  # (2, K, D)
    stats = next(iter(cfg.norm_stats.values()))["action"]
    for i, sample in enumerate(samples):
        got = _predict(model, sample)
        assert got.shape == (OFT.chunk, OFT.action_dim)
        close(got, unnormalize_actions(trained[i], stats), f"sample {i}")
    given = predict_action_chunk(  # statistics given apart (a dataset_statistics.json's dict)
        model,
        [samples[0]["image"], samples[0]["wrist_image"]],
        samples[0]["instruction"],
        samples[0]["state"],
        statistics={"other": {**next(iter(cfg.norm_stats.values()))}},
    )
    np.testing.assert_array_equal(given, _predict(model, samples[0]))
    with pytest.raises(ValueError, match="takes 2 images"):
        model.predict_action_chunk(samples[0]["image"], "go", samples[0]["state"])
    with pytest.raises(ValueError, match="proprio"):
        model.predict_action_chunk([samples[0]["image"]] * 2, "go")


def _layouts() -> dict[str, list]:
    out = {}
    for name, kw in (("tp2", dict(tp=2)), ("pp2", dict(pp=2))):
        ctx = context(**kw)
        model = _model(ctx)
        out[name] = [_predict(model, s).tolist() for s in _samples(model.config)]
    return out


def test_the_same_actions_at_tp2_and_pp2():
    model = _model()
    want = [_predict(model, s) for s in _samples(model.config)]
    for rank in run_ranks(_layouts, 2):
        for name, got in rank.items():
            close(np.array(got), np.array(want), name)


RUN = (
    *("--action-head", "l1", "--action-chunk", "2", "--film", "--finetune", "lora"),
    *("--lora-rank", "4", "--steps", "2", "--global-batch-size", "4", "--micro-batch-size", "2"),
    *("--lr", "2e-3", "--seed", "3", "--save-interval", "2", "--export-hf", "--log-interval", "1"),
)


def _train(out: str) -> bool:
    from parallax.train import parse_args
    from parallax.train.cli import resolve_run, run

    run(resolve_run(parse_args(["--tp", "2", "--out", out, *RUN])), context(tp=2))
    return True


def _policy_actions(path: str, tp: int) -> list:
    from parallax.data import SyntheticTask
    from parallax.families.openvla.oft.policy import load_policy

    model = load_policy(path, context(tp=tp) if tp > 1 else None)
    task = SyntheticTask(camera="static", wrist_image=True, state=True, chunk=2, episode_length=6)
    out = []
    for i in (0, 7):
        s = task[i]
        out.append(
            model.predict_action_chunk(
                [s["image"], s["wrist_image"]], s["instruction"], s["state"]
            ).tolist()
        )
    return out


def test_a_checkpoint_and_an_export_reload_and_give_the_same_actions(tmp_path):
    from safetensors import safe_open

    from parallax.families.openvla.oft.export import read_oft_files
    from parallax.families.openvla.oft.head import oft_key
    from parallax.families.openvla.oft.policy import load_policy

    out = tmp_path / "run"
    assert run_ranks(_train, 2, str(out)) == [True, True]  # LoRA at tp 2, exported
    ckpt = np.array(_policy_actions(str(out), 1))  # the training checkpoint at tp 1
    (at_tp2, _) = run_ranks(_policy_actions, 2, str(out), 2)
    close(np.array(at_tp2), ckpt, "tp2")
    hf = out / "hf"
    config = json.loads((hf / "config.json").read_text())
    assert config["parallax_oft"]["chunk"] == 2 and config["parallax_oft"]["num_images"] == 2
    stats = json.loads((hf / "dataset_statistics.json").read_text())
    assert "proprio" in next(iter(stats.values()))
    adapter = json.loads((hf / "adapter" / "adapter_config.json").read_text())
    assert adapter["r"] == 4 and not adapter["modules_to_save"]  # the head is not in it
    # the OFT modules as trained, bit for bit, in both formats
    trained = load_policy(out)
    want = {
        n: p.detach()
        for n, p in trained.named_parameters()
        if n.startswith(("action_head", "proprio"))
    }
    assert want and read_oft_files(hf).keys() >= want.keys()
    for module in ("action_head", "proprio_projector"):
        (pt,) = hf.glob(f"{module}--2_checkpoint.pt")
        state = torch.load(pt, weights_only=True)  # OFT's loader: no pickle runs
        assert all(k.startswith("module.") for k in state)
        with safe_open(hf / f"{module}.safetensors", "pt") as f:
            for name, value in want.items():
                owner, key = oft_key(name)
                if owner == module:
                    assert torch.equal(state["module." + key], value), name
                    assert torch.equal(f.get_tensor(key), value), name
    # the export: the merged base in bf16 (the HF layout's dtype), the OFT modules exact
    exported = load_policy(hf)
    got = dict(exported.named_parameters())
    for name, value in want.items():
        assert torch.equal(got[name], value), name
    actions = np.array(_policy_actions(str(hf), 1))
    # the merged weights rounded to bf16 move the actions by 1.4e-3 of their scale (measured)
    np.testing.assert_allclose(actions, ckpt, rtol=0, atol=5e-3 * np.abs(ckpt).max())
    assert np.abs(actions - ckpt).max() > 0  # bf16, not a copy of the checkpoint's weights
