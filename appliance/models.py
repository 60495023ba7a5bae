"""Models by name, and the trained-model directory every later stage reads.

A trained-model directory holds `model.safetensors` (weights) and `model.json` (the
model card: architecture, classes, preprocessing). Export, quantize and the edge runner
take preprocessing from the card, so it is stated once, where training decided it.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

from appliance.core.errors import ConfigError, DataError
from appliance.core.manifest import atomic_write_text

CARD_NAME = "model.json"
WEIGHTS_NAME = "model.safetensors"
TORCHVISION_ARCHITECTURES = ("resnet18", "resnet34", "resnet50", "mobilenet_v2", "mobilenet_v3_small",
                             "efficientnet_b0", "shufflenet_v2_x1_0")
ONNX_ARCHITECTURE = "onnx"  # the graph of `[model] init = "x.onnx"`, converted by onnx2torch
ONNX_GRAPH_NAME = "source.onnx"  # the imported graph, kept in the trained-model directory to rebuild the module
ARCHITECTURES = ("small_cnn", *TORCHVISION_ARCHITECTURES, ONNX_ARCHITECTURE)


@dataclass(frozen=True)
class ModelCard:
    architecture: str
    num_classes: int
    in_channels: int = 3
    image_size: int = 224
    mean: tuple[float, ...] = (0.485, 0.456, 0.406)
    std: tuple[float, ...] = (0.229, 0.224, 0.225)
    channel_order: str = "RGB"  # or "L" for one channel
    class_names: tuple[str, ...] = ()
    extra: dict = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2) + "\n"

    @classmethod
    def read(cls, path: Path) -> "ModelCard":
        """The card in the file at path: one line for a file that is no card (not a regular file, not UTF-8)."""
        if not Path(path).is_file():
            raise DataError(f"{path}: not a regular file (a device, pipe or folder), so not a model card")
        try:
            return cls.from_json(Path(path).read_bytes().decode("utf-8"), str(path))
        except UnicodeDecodeError as err:
            raise DataError(f"{path}: not a valid model card (byte {err.start} is not UTF-8 text)") from None

    @classmethod
    def from_json(cls, text: str, source: str = "model.json") -> "ModelCard":
        try:
            raw = json.loads(text)
            raw["mean"], raw["std"] = tuple(raw["mean"]), tuple(raw["std"])
            raw["class_names"] = tuple(raw.get("class_names", ()))
            return cls(**raw)
        except (ValueError, TypeError, KeyError, RecursionError) as err:  # JSONDecodeError is a ValueError
            raise DataError(f"{source}: not a valid model card ({str(err)[:200]})") from None


def small_cnn(num_classes: int, in_channels: int = 3):
    """A compact CNN for small images (8-64 px): three conv blocks, global pooling, a linear head."""
    from torch import nn

    def block(cin, cout):
        return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True))

    return nn.Sequential(
        block(in_channels, 32), block(32, 32), nn.MaxPool2d(2),
        block(32, 64), block(64, 64), nn.MaxPool2d(2),
        block(64, 128),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(128, num_classes),
    )


def classifier_head(model) -> str:
    """The name of the model's classifier head: its last Linear layer (fc, classifier.1, 9, ...)."""
    from torch import nn

    names = [name for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    return names[-1] if names else ""


def _inline_initializer_identities(proto) -> None:
    """Identity nodes that only rename an initializer (torch's exporter writes them for shared
    constants) become initializers of their own: onnx2torch reads Conv/Gemm weights from initializers."""
    from onnx import numpy_helper

    inits = {init.name: init for init in proto.graph.initializer}
    for node in list(proto.graph.node):
        if node.op_type == "Identity" and node.input[0] in inits and node.output[0] not in inits:
            copy = numpy_helper.from_array(numpy_helper.to_array(inits[node.input[0]]), node.output[0])
            proto.graph.initializer.append(copy)
            inits[copy.name] = copy
            proto.graph.node.remove(node)


# Elements in one tensor of a graph we accept (1 GiB of float32): ~300x the largest activation of
# ResNet-50 at 224 px. A ConstantOfShape of [1, 2^20, 2^20] is a memory bomb, not a model.
MAX_TENSOR_ELEMENTS = 1 << 28


def check_tensor_sizes(proto, path) -> None:
    """Every tensor whose shape ONNX shape inference can tell (symbolic axes count as 1) holds at
    most MAX_TENSOR_ELEMENTS; DataError naming the node and the size otherwise, before any runtime
    allocates it (onnxruntime, onnx2torch and TVM's constant folding all would)."""
    import math

    import onnx

    try:
        inferred = onnx.shape_inference.infer_shapes(proto, data_prop=True)
    except Exception:  # noqa: BLE001 - a graph inference cannot follow is judged by the runtime
        return
    producers = {out: node for node in inferred.graph.node for out in node.output}
    for value in [*inferred.graph.value_info, *inferred.graph.output]:
        dims = value.type.tensor_type.shape.dim
        elements = math.prod(d.dim_value if d.HasField("dim_value") else 1 for d in dims)
        if elements > MAX_TENSOR_ELEMENTS:
            node = producers.get(value.name)
            what = f"{node.op_type} node {node.name or value.name!r}" if node else f"tensor {value.name!r}"
            shape = "x".join(str(d.dim_value) if d.HasField("dim_value") else d.dim_param or "?" for d in dims)
            raise DataError(f"{path}: {what} makes a tensor of {elements} elements ({shape}), more than "
                            f"{MAX_TENSOR_ELEMENTS} (a memory bomb, not an image model)")


def onnx_module(path: str | Path, num_classes: int, in_channels: int | None = None):
    """A trainable torch module (a torch.fx GraphModule) from an ONNX graph, its weights included.

    The head is replaced by a fresh Linear layer when the graph's class count is not num_classes.
    An operator onnx2torch cannot convert is one line naming the operator and the node."""
    import onnx
    from onnx2torch import convert
    from torch import nn

    try:
        proto = onnx.load(str(path))
    except Exception as err:  # protobuf's DecodeError and onnx's own
        raise DataError(f"{path}: not an ONNX model ({type(err).__name__}: {err})") from None
    check_tensor_sizes(proto, path)
    _inline_initializer_identities(proto)
    if in_channels is not None:
        _check_input_channels(proto, path, in_channels)
    from onnx2torch.node_converters.registry import get_converter

    opsets = {opset.domain: opset.version for opset in proto.opset_import}
    for node in proto.graph.node:
        try:
            get_converter(node.op_type, opsets.get(node.domain, 1), node.domain)
        except NotImplementedError:
            raise DataError(f"{path}: onnx2torch cannot convert operator {node.op_type} (opset "
                            f"{opsets.get(node.domain, 1)}) of node {node.name or node.output[0]!r}; "
                            "re-export the model without it") from None
    try:
        model = convert(proto)
    except Exception as err:  # a converter that refuses an attribute of its operator, and the like
        raise DataError(f"{path}: onnx2torch could not convert the graph "
                        f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})") from None
    head = classifier_head(model)
    if head and model.get_submodule(head).out_features != num_classes:
        old = model.get_submodule(head)
        parent = model.get_submodule(head.rsplit(".", 1)[0]) if "." in head else model
        setattr(parent, head.rsplit(".", 1)[-1], nn.Linear(old.in_features, num_classes, bias=old.bias is not None))
        model.replaced_head = (head, old.out_features, num_classes)
    return model


def _check_input_channels(proto, path, in_channels: int) -> None:
    """The graph's image input must take [data] channels: one line now instead of a shape error in the
    first training step."""
    weights = {i.name for i in proto.graph.initializer}
    inputs = [i for i in proto.graph.input if i.name not in weights]
    if not inputs:
        return
    dims = inputs[0].type.tensor_type.shape.dim
    if len(dims) == 4 and dims[1].HasField("dim_value") and dims[1].dim_value != in_channels:
        raise DataError(f"{path}: the graph's input {inputs[0].name!r} takes {dims[1].dim_value} channels, "
                        f"the data has {in_channels} ([data] channels)")


def build_model(architecture: str, num_classes: int, in_channels: int = 3, onnx_graph: str | Path | None = None):
    """A freshly initialised model (never downloads weights: the appliance is offline); architecture
    "onnx" is the module converted from onnx_graph, with the graph's weights."""
    if architecture == ONNX_ARCHITECTURE:
        if onnx_graph is None:
            raise ConfigError('architecture "onnx" needs the ONNX graph ([model] init = "model.onnx")')
        return onnx_module(onnx_graph, num_classes, in_channels)
    if architecture == "small_cnn":
        return small_cnn(num_classes, in_channels)
    if architecture not in TORCHVISION_ARCHITECTURES:
        raise ConfigError(f"unknown model architecture {architecture!r}; choose one of {', '.join(ARCHITECTURES)}")
    import torchvision
    from torch import nn

    model = getattr(torchvision.models, architecture)(weights=None, num_classes=num_classes)
    if in_channels != 3:
        # Replace the first convolution so one-channel (or other) inputs work.
        for name, module in model.named_modules():
            if isinstance(module, nn.Conv2d):
                new = nn.Conv2d(in_channels, module.out_channels, module.kernel_size, module.stride,
                                module.padding, bias=module.bias is not None)
                parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
                setattr(parent, name.rsplit(".", 1)[-1], new)
                break
    return model


def save_trained_model(out_dir: str | Path, model, card: ModelCard, onnx_graph: str | Path | None = None) -> Path:
    """Write weights + card (+ the imported ONNX graph of an "onnx" model) into out_dir (created). Atomic per file."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / f".{WEIGHTS_NAME}.tmp"
    state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(tmp))
    tmp.replace(out_dir / WEIGHTS_NAME)
    if onnx_graph is not None:  # the module's structure: load_trained_model rebuilds it from this graph
        tmp = out_dir / f".{ONNX_GRAPH_NAME}.tmp"
        shutil.copyfile(onnx_graph, tmp)
        tmp.replace(out_dir / ONNX_GRAPH_NAME)
    atomic_write_text(out_dir / CARD_NAME, card.to_json())
    return out_dir


def nonfinite_weights(state: dict) -> str | None:
    """The first float tensor of a state dict holding NaN or infinity, described; None if there is none.
    Such weights make every output NaN: a run that diverged, or a file changed by someone."""
    import torch

    for key, tensor in state.items():
        if tensor.dtype.is_floating_point or tensor.dtype.is_complex:
            bad = int((~torch.isfinite(tensor)).sum())
            if bad:
                return f"{key} holds {bad} NaN or infinite value(s) of {tensor.numel()}"
    return None


def mismatched_weights(state: dict, own: dict, shapes: bool = True) -> str | None:
    """The first tensor of `state` that the model's state dict `own` cannot take as it is: another
    shape (shapes=True), or a dtype of another kind. A float tensor relabelled as int32 keeps its
    bytes and its size, and load_state_dict would cast the integers it now reads: refused."""
    for key, tensor in state.items():
        mine = own.get(key)
        if mine is None:
            continue
        if shapes and tuple(tensor.shape) != tuple(mine.shape):
            return f"{key} has shape {tuple(tensor.shape)}, the model's is {tuple(mine.shape)}"
        if (tensor.dtype.is_floating_point, tensor.dtype.is_complex) != (mine.dtype.is_floating_point,
                                                                        mine.dtype.is_complex):
            return f"{key} is {tensor.dtype} where the model has {mine.dtype} (relabelled or other weights)"
    return None


def load_trained_model(model_dir: str | Path, build=None):
    """(model in eval mode, card) from a trained-model directory. Loads no pickle.
    build: the card's task's build_model (appliance.tasks), default classification's build_model."""
    from safetensors.torch import load_file

    model_dir = Path(model_dir)
    card_path, weights = model_dir / CARD_NAME, model_dir / WEIGHTS_NAME
    if not card_path.exists() or not weights.exists():
        raise DataError(f"{model_dir}: not a trained-model directory (needs {CARD_NAME} and {WEIGHTS_NAME})")
    if not weights.is_file():  # a FIFO would be waited on forever, a device read forever
        raise DataError(f"{weights}: not a regular file (a device, pipe or folder)")
    card = ModelCard.read(card_path)
    graph = model_dir / card.extra.get("onnx_graph", ONNX_GRAPH_NAME)
    model = (build or build_model)(card.architecture, card.num_classes, card.in_channels, onnx_graph=graph)
    try:
        state = load_file(str(weights))
    except Exception as err:  # safetensors raises its own error types for damaged files
        raise DataError(f"{weights}: unreadable weights ({err})") from None
    problem = mismatched_weights(state, model.state_dict()) or nonfinite_weights(state)
    if problem:
        raise DataError(f"{weights}: {problem}; these weights cannot be used")
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise DataError(f"{weights}: weights do not match {card.architecture} "
                        f"(missing {list(missing)[:3]}, unexpected {list(unexpected)[:3]})")
    return model.eval(), card
