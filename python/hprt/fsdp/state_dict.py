"""A fully_shard model's state dict as whole tensors (a collective) or this rank's shards, and
loading it back."""

import torch


def _params_by_ptr(model):
    out = {}
    for m in model.modules():
        st = getattr(m, "_hprt_fsdp", None)
        if st is not None:
            st.reshard()
            for p in st.params:
                out[p.sharded.data_ptr()] = p
    return out


def get_model_state_dict(model, *, full_state_dict=True):
    """The model's state dict with each sharded parameter as its whole tensor
    (``full_state_dict``; a collective: every rank calls it) or as this rank's padded shard,
    cloned to torch memory."""
    by_ptr = _params_by_ptr(model)
    out = {}
    for k, v in model.state_dict().items():
        p = by_ptr.get(v.data_ptr()) if torch.is_tensor(v) else None
        if p is not None and v.shape == p.sharded.shape:
            out[k] = p.full_tensor() if full_state_dict else v.detach().clone()
        else:
            out[k] = v.clone() if torch.is_tensor(v) else v
    return out


def set_model_state_dict(model, state_dict, *, full_state_dict=True, strict=True):
    """Loads a state dict from ``get_model_state_dict`` (whole tensors, or this rank's shards)."""
    by_ptr = _params_by_ptr(model)
    current = model.state_dict()
    converted = {}
    for k, v in state_dict.items():
        cur = current.get(k)
        p = by_ptr.get(cur.data_ptr()) if torch.is_tensor(cur) else None
        if p is not None and cur.shape == p.sharded.shape and full_state_dict:
            converted[k] = p.shard_of(v)
        else:
            converted[k] = v
    for st in {id(p.state): p.state for p in by_ptr.values()}.values():
        st.streams.compute.synchronize()  # nothing queued still reads the shards
    return model.load_state_dict(converted, strict=strict)
