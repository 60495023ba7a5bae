"""`[model] init`: the weights a run starts from, and the report of how they matched the model.

One of: a safetensors state dict; a trained-model directory (runs/x/model) or a run directory; a
checkpoint directory of another run (weights only: optimizer and schedule start fresh); a torchvision
`.pth` (read with torch.load(weights_only=True), so a pickle that would run code is refused, never run);
`torchvision:NAME` from the install's weights/ (appliance.assets.weights); an ONNX model (architecture "onnx",
converted by onnx2torch in appliance.models). Keys are matched by name. The file's sha256 is part of
the run's config hash, so a resumed run refuses other starting weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from appliance.core.errors import ConfigError, DataError
from appliance.models import (CARD_NAME, ONNX_ARCHITECTURE, WEIGHTS_NAME, classifier_head, mismatched_weights,
                              nonfinite_weights)
from appliance.core.manifest import sha256_file
from appliance.assets.weights import PREFIX as TORCHVISION_PREFIX, find_weights
from appliance.train.checkpoint_files import CheckpointDamaged, read_sums

KINDS = ("safetensors", "model_dir", "checkpoint", "torchvision", "pth", "onnx")


@dataclass(frozen=True)
class InitSource:
    spec: str   # as the config wrote it
    kind: str   # one of KINDS
    path: Path  # the file read (and hashed)
    sha256: str


def resolve_init(spec: str, base: Path, source: str) -> InitSource:
    """The file behind `[model] init`, hashed; one line naming the config when it is not usable."""
    where = f"{source}: [model] init {spec!r}"
    if spec.startswith(TORCHVISION_PREFIX):
        try:
            found = find_weights(spec[len(TORCHVISION_PREFIX):])
        except ConfigError as err:
            raise ConfigError(f"{where}: {err}") from None
        return InitSource(spec, "torchvision", found.path, found.sha256)
    path = Path(spec) if Path(spec).is_absolute() else base / spec
    path = path.resolve()
    if path.is_dir():
        if (path / "model" / WEIGHTS_NAME).is_file():  # a run directory: its trained model
            path = path / "model"
        if (path / WEIGHTS_NAME).is_file() and (path / CARD_NAME).is_file():
            kind = "checkpoint" if (path / "SHA256SUMS").is_file() else "model_dir"
            weights = path / WEIGHTS_NAME
            digest = sha256_file(weights)
            if kind == "checkpoint":
                _check_listed(path, digest, where)
            return InitSource(spec, kind, weights, digest)
        raise ConfigError(f"{where}: {path} is neither a trained-model directory nor a checkpoint "
                          f"(needs {WEIGHTS_NAME} and {CARD_NAME})")
    if not path.is_file():
        raise ConfigError(f"{where}: {path} does not exist")
    kind = {".safetensors": "safetensors", ".pth": "pth", ".pt": "pth", ".onnx": "onnx"}.get(path.suffix)
    if kind is None:
        raise ConfigError(f"{where}: {path.name} is not .safetensors, .pth, .pt or .onnx, a model or checkpoint "
                          f"directory, or {TORCHVISION_PREFIX}NAME")
    return InitSource(spec, kind, path, sha256_file(path))


def _check_listed(checkpoint: Path, digest: str, where: str) -> None:
    """The weights of another run's checkpoint are those its SHA256SUMS lists (read as resume reads it)."""
    try:
        listed = read_sums(checkpoint)
    except CheckpointDamaged as err:
        raise ConfigError(f"{where}: {checkpoint}: {err}") from None
    if listed.get(WEIGHTS_NAME) != digest:
        raise ConfigError(f"{where}: {checkpoint / WEIGHTS_NAME} fails its sha256 check against "
                          f"{checkpoint / 'SHA256SUMS'} (damaged or changed after saving)")


def read_state(init: InitSource) -> dict:
    """The tensors of a weights file (not ONNX: that graph is the model itself). No pickle is run."""
    import pickle

    import torch

    if init.kind in ("pth", "torchvision"):
        try:
            state = torch.load(init.path, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError:
            raise DataError(f"{init.path}: not a weights-only file (its pickle would run code, so it is not "
                            "loaded); save a state dict with torch.save(model.state_dict()) or as safetensors") from None
        except (RuntimeError, EOFError, OSError) as err:
            raise DataError(f"{init.path}: unreadable torch weights ({str(err).splitlines()[0]})") from None
        for key in ("state_dict", "model"):  # training scripts often wrap the state dict
            if isinstance(state, dict) and isinstance(state.get(key), dict):
                state = state[key]
        if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
            raise DataError(f"{init.path}: not a state dict (expected names mapped to tensors)")
        return state
    from safetensors.torch import load_file

    try:
        return load_file(str(init.path))
    except Exception as err:  # safetensors raises its own error types for damaged files
        raise DataError(f"{init.path}: unreadable safetensors weights ({err})") from None


def _covered(key: str, prefixes) -> bool:
    """key is prefix itself or inside it ("fc" covers fc.weight, not fc2.weight; "0/" covers ONNX names)."""
    return any(key == p or key.startswith(p if p.endswith((".", "/")) else (p + ".", p + "/")) for p in prefixes)


def check_reset(model, own: dict, reset, architecture: str) -> None:
    """Every [model] reset prefix names a parameter, and some parameter is left to load from init."""
    for prefix in reset:
        if not any(_covered(k, [prefix]) for k in own):
            raise ConfigError(f"[model] reset: {prefix!r} matches no parameter of {architecture} "
                              f"(e.g. {', '.join(list(own)[:3])})")
    trained = [name for name, _ in model.named_parameters()]
    if reset and trained and all(_covered(k, reset) for k in trained):
        raise ConfigError(f"[model] reset re-initialises every parameter of {architecture}: nothing of [model] init "
                          "would be loaded (remove init, or reset only the layers to learn afresh)")


def apply_init(model, init: InitSource, reset: tuple[str, ...], architecture: str, log=print, task=None) -> dict:
    """Load init's weights into model by name; the report of what matched. Keys under `reset` (and a
    classifier head whose class count differs) keep their fresh initialisation; any other
    missing or shape-mismatched parameter means weights of another architecture: one line.
    task (appliance.tasks; None: classification) names the head and may rename the weights' keys:
    a classification backbone's onto a segmentation model, whose head then starts fresh."""
    import torch

    head = task.head_prefix(model, architecture) if task is not None else classifier_head(model)
    own = model.state_dict()
    check_reset(model, own, reset, architecture)
    if architecture == ONNX_ARCHITECTURE:  # the module was built from the graph, weights included
        state, mapping = {k: v for k, v in own.items()}, None
        mismatched, missing, unexpected = [], [], []
    else:
        state, mapping = read_state(init), None
        if task is not None:
            state, mapping = task.init_state(state, own, architecture)
        mismatched = [k for k in own if k in state and tuple(state[k].shape) != tuple(own[k].shape)]
        missing = [k for k in own if k not in state]
        unexpected = sorted(k for k in state if k not in own)
    adapted = _adapt_input_conv(own, state, mismatched, reset)
    mismatched = [k for k in mismatched if k not in adapted]
    # A classification backbone brings no segmentation head: that head is missing, and starts fresh.
    absent_head = missing if architecture != ONNX_ARCHITECTURE and mapping else []
    head_keys = [k for k in mismatched + absent_head if head and _covered(k, [head]) and not _covered(k, reset)]
    reinit = [k for k in own if _covered(k, reset)] + head_keys
    params = {name for name, _ in model.named_parameters()}
    fatal = [k for k in mismatched + missing if k not in reinit and k in params]
    if fatal:
        shapes = [f"{k} {tuple(state[k].shape)} vs {tuple(own[k].shape)}" if k in state else f"{k} (missing)"
                  for k in fatal[:3]]
        raise DataError(f"{init.path}: weights do not fit {architecture}: first mismatched keys {', '.join(shapes)}"
                        + (f"; unexpected {', '.join(unexpected[:3])}" if unexpected else "")
                        + "; list them in [model] reset to re-initialise them")
    kept = {k: v for k, v in state.items() if k in own and k not in reinit}
    problem = mismatched_weights(kept, own, shapes=False) or nonfinite_weights(kept)
    if problem:
        raise DataError(f"{init.path}: {problem}; these weights cannot start training")
    fresh = model.state_dict()
    loaded = {k: (fresh[k] if k in reinit else state[k]) for k in own if k in state or k in reinit}
    if architecture == ONNX_ARCHITECTURE:
        with torch.no_grad():
            for name, module in model.named_modules():
                direct = [f"{name}.{p}" for p, _ in module.named_parameters(recurse=False)]
                if direct and any(_covered(k, reset) for k in direct) and hasattr(module, "reset_parameters"):
                    module.reset_parameters()
    else:
        model.load_state_dict(loaded, strict=False)
    report = {"init": init.spec, "kind": init.kind, "path": str(init.path), "sha256": init.sha256,
              "loaded": len([k for k in loaded if k not in reinit]), "missing": missing,
              "unexpected": unexpected,
              "shape_mismatched": [{"key": k, "weights": list(state[k].shape), "model": list(own[k].shape)}
                                   for k in mismatched],
              "reset": [k for k in own if _covered(k, reset)], "head_reinitialised": head_keys,
              "input_channels_adapted": adapted}
    if task is not None and task.kind != "classification":  # which tensors came from the weights, by name
        report.update(mapping or {}, loaded_keys=[k for k in loaded if k not in reinit])
    log(f"init: {report['loaded']} tensors from {init.path} ({init.kind}, sha256 {init.sha256[:12]}); "
        f"missing {len(missing)}, unexpected {len(unexpected)}, shape-mismatched {len(mismatched)}")
    replaced = getattr(model, "replaced_head", None)  # set by appliance.models.onnx_module
    if replaced:
        log(f"init: classifier head {replaced[0]} re-initialised ({replaced[1]} classes in the graph, "
            f"{replaced[2]} here)")
        report["head_reinitialised"] = [k for k in own if _covered(k, [replaced[0]])]
    for key, (was, now) in adapted.items():
        log(f"init: input conv {key} adapted from {was} to {now} channels (RGB filters "
            + ("summed, exact for a grey image repeated to RGB)" if now == 1 else "cycled and rescaled)"))
    if mapping:
        log(f"init: {mapping['backbone_mapping']}: {mapping['backbone_keys_mapped']} tensors; not used: "
            f"{len(mapping['classification_keys_not_used'])} (the classifier); head {head} starts fresh")
    elif head_keys:
        old, new = state[head_keys[0]].shape[0], own[head_keys[0]].shape[0]
        log(f"init: classifier head {head} re-initialised ({old} classes in the weights, {new} here)")
    if report["reset"]:
        log(f"init: re-initialised by [model] reset: {', '.join(report['reset'][:6])}")
    return report


def _adapt_input_conv(own: dict, state: dict, mismatched: list[str], reset) -> dict:
    """Pretrained RGB weights for a model of other input channels (grey scans: 1): the model's first conv
    weight is adapted in `state`, as fine-tuners expect, instead of refusing or losing it. One channel
    gets the sum of the RGB filters (a grey image repeated to RGB gives the same output); N channels
    cycle the RGB filters, scaled by 3/N so the output's magnitude stays. {key: (weights', model's channels)}."""
    first = next((k for k, v in own.items() if v.ndim == 4), None)
    if first is None or first not in mismatched or _covered(first, reset):
        return {}
    was, now = tuple(state[first].shape), tuple(own[first].shape)
    if was[:1] + was[2:] != now[:1] + now[2:]:  # only the input channels may differ
        return {}
    weight = state[first].to(own[first].dtype)
    if now[1] == 1:
        adapted = weight.sum(dim=1, keepdim=True)
    else:
        adapted = weight[:, [i % was[1] for i in range(now[1])]] * (was[1] / now[1])
    state[first] = adapted.contiguous()
    return {first: (was[1], now[1])}
