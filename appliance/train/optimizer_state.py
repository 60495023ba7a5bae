"""An optimizer's state_dict <-> (its tensors for safetensors, the rest for JSON): how checkpoints store
an optimizer, whole or one ZeRO shard per rank, without pickle.
"""

from __future__ import annotations

import torch


def split_optimizer_state(state_dict: dict) -> tuple[dict, dict]:
    tensors, rest = {}, {}
    for index, per_param in state_dict["state"].items():
        for key, value in per_param.items():
            if torch.is_tensor(value):
                tensors[f"{index}.{key}"] = value.detach().cpu().contiguous()
            else:
                rest.setdefault(str(index), {})[key] = value
    return tensors, {"param_groups": state_dict["param_groups"], "state": rest}


def join_optimizer_state(tensors: dict, rest: dict) -> dict:
    state: dict[int, dict] = {int(i): dict(v) for i, v in rest["state"].items()}
    for name, value in tensors.items():
        index, key = name.split(".", 1)
        state.setdefault(int(index), {})[key] = value
    return {"state": dict(sorted(state.items())), "param_groups": rest["param_groups"]}
