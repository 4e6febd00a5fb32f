"""hyper_parallel's layer-group swap under its own names, so that code written for it runs on hprt
(the ``swap`` mode): ``SwapManager``'s module hooks over the Rust ``SwapManager``, tensors
swapped in place with their layer's group (``add_storage``, ``swap_tensor_wrapper``), and the
module wrappers whose regions alone save into a layer's group (``swap_wrapper``,
``checkpoint_wrapper``)."""

import contextlib
import enum
import warnings
import weakref

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks

from .memory import _HPRT_DTYPES
from .passes import _Flow, _Kept, _Packed, _declined, _on_output_grad, _pushed, _unpack_with
from .runtimes import is_swappable, runtime


def _tensors_in(tree):
    """The torch tensors of a tensor, a nested list / tuple / dict, or an object with
    ``values()`` (hyper_parallel's ``Storage``)."""
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            yield from _tensors_in(v)
    elif isinstance(tree, dict) or hasattr(tree, "values"):
        for v in tree.values():
            yield from _tensors_in(v)


class SwapManager:
    """hyper_parallel's layer-group swap on torch modules, a singleton per runtime like
    upstream's: ``set_forward_prefetch_layer(a, b)`` installs module hooks that call the Rust
    ``SwapManager``; a layer never named second begins a forward pass. ``detach()`` (and the
    ``reset()`` class method) removes every hook."""

    _instances = {}

    def __new__(cls, runtime_=None, min_bytes=None, custom_check_fn=None):
        rt = runtime_ if runtime_ is not None else runtime()
        inst = cls._instances.get(id(rt))
        if inst is None:
            inst = super().__new__(cls)
            inst.rt = rt
            inst.min_bytes = min_bytes or 0
            inst.custom_check_fn = custom_check_fn
            # module -> its layer; weak (a module's id() is reused once it is freed: a new
            # model's block at a freed one's address got no hooks).
            inst.layers = weakref.WeakKeyDictionary()
            inst.seconds = set()
            inst.handles = []
            inst.flow = _Flow(inst._end_iteration)
            inst.wrapped = 0  # swap_wrapper regions: then only they save into the layer's group
            inst.recording = None
            inst.in_layer = 0  # layer forwards running (hooked), taken or not
            inst.named = []  # modules given a ``_swap_group_name``
            # Tensors swapped in place (add_storage / swap_tensor_wrapper): group name ->
            # [hprt's reference, the tensor, whether its storage is released now].
            inst.in_place = {}
            cls._instances[id(rt)] = inst
        elif (min_bytes is not None and min_bytes != inst.min_bytes) or (
                custom_check_fn is not None and custom_check_fn is not inst.custom_check_fn):
            raise ValueError(
                "SwapManager is a singleton (one per runtime): it was made with min_bytes="
                f"{inst.min_bytes}; call SwapManager.reset() first to change its settings")
        return inst

    def __init__(self, runtime_=None, min_bytes=None, custom_check_fn=None):
        pass

    @classmethod
    def reset(cls):
        """Removes every instance's hooks and forgets the instances."""
        for inst in list(cls._instances.values()):
            inst.detach()
        cls._instances.clear()

    def detach(self):
        for h in self.handles:
            h.remove()
        for ref in self.named:
            module = ref()
            if module is not None and hasattr(module, "_swap_group_name"):
                del module._swap_group_name
        layers = list(self.layers.values())
        self.handles, self.seconds, self.named = [], set(), []
        self.layers = weakref.WeakKeyDictionary()
        self.flow.settle()
        if self.flow.current is None:  # no pass alive: the next attach may order them anew
            for layer in layers:
                self.rt.layers.unlink(layer)

    def _layer(self, module):
        layer = self.layers.get(module)
        if layer is None:
            slots = self.rt._layer_slots
            layer = slots.get(module)
            if layer is None:
                layer = slots[module] = self.rt.layers.new_layer()
            self.layers[module] = layer
            # hyper_parallel names the module's group on the module.
            module._swap_group_name = f"swap_group_{layer}"
            self.named.append(weakref.ref(module))
            self._register_hooks(module, layer)
        return layer

    def set_forward_prefetch_layer(self, first_layer, second_layer):
        """``second_layer`` runs after ``first_layer`` in forward; idempotent."""
        a, b = self._layer(first_layer), self._layer(second_layer)
        self.seconds.add(b)
        self.rt.layers.set_forward_prefetch_layer(a, b)

    # hyper_parallel's group calls, by name
    def add_storage(self, group_name, storage):
        """hyper_parallel's ``add_storage``: the torch tensors in ``storage`` (a tensor, a
        nested list / tuple / dict of them, or an object with ``values()`` like hyper_parallel's
        ``Storage``) join group ``group_name``, swapped in place as hyper_parallel swaps them:
        once the group's offload was waited for (``wait_offload``, or the next layer's forward)
        their device storage is released (``untyped_storage().resize_(0)``), ``launch_load``
        re-acquires it and queues the copy back, and after ``wait_load`` (or the layer's
        backward hook) the same tensor objects hold their bytes again. A tensor that is not
        swappable (a parameter, a leaf that requires grad, not dense, not on this platform's
        device) or does not cover its whole storage (releasing it would take its neighbours)
        stays on the device. hprt payloads (``FrameworkMemory.tensor``, ``DeviceTensor``) are
        added as they are; returns their reference."""
        if not isinstance(storage, torch.Tensor) and hasattr(storage, "nbytes") and (
                not isinstance(storage, (list, tuple, dict))):
            return self.rt.layers.add_storage(group_name, storage)
        entries = self.in_place.setdefault(group_name, [])
        seen = {e[1].untyped_storage().data_ptr() for e in entries}
        for t in _tensors_in(storage):
            storage_ = t.untyped_storage()
            whole = t.storage_offset() == 0 and storage_.nbytes() == t.nbytes
            if not whole or storage_.data_ptr() in seen or not is_swappable(t, self.rt):
                continue
            seen.add(storage_.data_ptr())
            # ``t.detach()``: the same storage and version counter, without ``t``'s autograd
            # node (holding it would keep the whole graph alive).
            d = t.detach()

            def reacquire(d=d, nbytes=t.nbytes, rt=self.rt):
                d.untyped_storage().resize_(nbytes)
                return rt.handed_out(d.detach())

            payload = self.rt.memory.tensor(d.detach(), reacquire, _HPRT_DTYPES.get(t.dtype, "u8"))
            entries.append([self.rt.layers.add_storage(group_name, payload), d, False])
        return None

    def _sync_in_place(self):
        """Releases the in-place tensors whose offload was waited for, and lets go of those
        whose reload the compute stream waits for."""
        for group, entries in list(self.in_place.items()):
            keep = []
            for entry in entries:
                ref, t, released = entry
                state = self.rt.layers.state(ref)
                if state == "host" and not released:
                    t.untyped_storage().resize_(0)
                    entry[2] = True
                elif released and state == "device":
                    self.rt.layers.take(ref)  # back in place: hprt holds it no more
                    continue
                keep.append(entry)
            if keep:
                self.in_place[group] = keep
            else:
                del self.in_place[group]

    def _end_iteration(self):
        """Ends the front end's iteration; in-place tensors still released (their graph was
        dropped before its backward) get their bytes back first, so no tensor object is left
        without its storage."""
        for group, entries in list(self.in_place.items()):
            if any(e[2] for e in entries):
                self.rt.layers.launch_load(group)
                self.rt.layers.wait_load(group, self.rt.compute_stream(None))
        self.in_place.clear()
        self.rt.layers.end_iteration()

    def launch_offload(self, group_name, copy_stream=None):
        """hyper_parallel: queues the group's offload after torch's current stream (hprt's
        own copy stream; ``copy_stream`` is not used)."""
        self.rt.layers.launch_offload(group_name, self.rt.compute_stream(None))

    def wait_offload(self, group_name):
        """hyper_parallel: waits for the group's offload; its device memory is released."""
        self.rt.layers.wait_offload(group_name)
        self._sync_in_place()

    def launch_load(self, group_name, copy_stream=None):
        """hyper_parallel: re-acquires the group's device memory and queues its reload."""
        self.rt.layers.launch_load(group_name)

    def wait_load(self, group_name):
        """hyper_parallel: torch's current stream (and, for CPU tensors, the host) waits for
        the group's reload; its tensors are usable again."""
        self.rt.layers.wait_load(group_name, self.rt.compute_stream(None))
        self._sync_in_place()

    def get_current_group_name(self):
        return self.rt.layers.get_current_group_name()

    def set_current_group_name(self, name):
        self.rt.layers.set_current_group_name(name)

    def is_last_group(self, group_name=None):
        """hyper_parallel: whether group ``group_name`` (the current one by default) ends the
        chain of layers linked by ``set_forward_prefetch_layer`` (it is never offloaded)."""
        name = group_name if group_name is not None else self.get_current_group_name()
        return bool(name) and self.rt.layers.is_last_group(name)

    def stats(self):
        return self.rt.stats()

    def _pack(self, t, policy_fn=None):
        if not is_swappable(t, self.rt, self.min_bytes, self.custom_check_fn):
            return _declined(t)
        if policy_fn is not None:
            policy = policy_fn(t)
            if policy in (ActivationPolicy.SAVE, CheckpointPolicy.MUST_SAVE):
                return _Kept(self.rt.borrow(t), t)
            if policy not in (ActivationPolicy.SWAP, CheckpointPolicy.MUST_SWAP):
                raise ValueError(f"swap_wrapper policy_fn returned {policy!r}, not "
                                 "ActivationPolicy.SAVE / SWAP nor CheckpointPolicy.MUST_SAVE / "
                                 "MUST_SWAP")
        return _Packed(self.rt.layers.save(self.rt.borrow(t)), t, None, self.flow.current)

    def _region(self, policy_fn):
        """The saved-tensor hooks of a ``swap_wrapper`` region, or None outside a recorded layer."""
        if self.recording is None or not self.flow.taking():
            return None
        return saved_tensors_hooks(lambda t: self._pack(t, policy_fn), _unpack_with(self._load))

    def _begin_backward(self, layer, pass_):
        if pass_ is None or layer not in pass_.begun:
            if pass_ is not None:
                pass_.begun.add(layer)
            # The compute stream now waits for the whole group (on the cpu backend the host
            # did, once for every tensor of the layer).
            self.rt.layers.backward_pre(layer, self.rt.compute_stream())
            if self.in_place:
                self._sync_in_place()

    def _load(self, packed):
        # A layer whose backward hook did not run (a partial backward) is loaded here.
        pass_ = packed.pass_
        if pass_ is None or packed.ref[0] not in pass_.begun:
            self._begin_backward(packed.ref[0], pass_)
        return self.rt.layers.take(packed.ref)

    def _register_hooks(self, module, layer):
        front, rt, flow = self.rt.layers, self.rt, self.flow
        open_hooks = []
        unpack = _unpack_with(self._load)

        def forward_pre(mod, args):
            self.in_layer += 1
            if layer not in self.seconds:
                flow.start()
            ctx = None
            if flow.taking() and front.forward_pre(layer):
                self.recording = layer
                # Without swap_wrapper regions the whole layer saves into its group.
                ctx = _pushed(self._pack, unpack) if not self.wrapped else False
            open_hooks.append(ctx)

        def forward_post(mod, args, output):
            self.in_layer = max(0, self.in_layer - 1)
            ctx = open_hooks.pop() if open_hooks else None
            if ctx is None:
                return
            self.recording = None
            if ctx is not False:
                ctx.__exit__(None, None, None)
            front.forward_post(layer, rt.compute_stream(None))
            if self.in_place:
                self._sync_in_place()
            pass_ = flow.current
            _on_output_grad(output, lambda: self._begin_backward(layer, pass_))

        self.handles.append(module.register_forward_pre_hook(forward_pre))
        self.handles.append(module.register_forward_hook(forward_post, always_call=True))


# ---- hyper_parallel's swap_wrapper -------------------------------------------------------------


class ActivationPolicy(enum.Enum):
    """hyper_parallel's per-tensor choice in a ``swap_wrapper`` region."""

    SAVE = "save"
    SWAP = "swap"


_WRAPPED = "_swap_wrapped_module"


def _replace_prefix(state_dict, old, new):
    for key in [k for k in state_dict if k.startswith(old)]:
        state_dict[new + key[len(old):]] = state_dict.pop(key)


class SwapWrapper(nn.Module):
    """hyper_parallel's ``swap_wrapper`` module: the wrapped module's saved tensors join the
    current layer's group of the ``SwapManager`` (the layers linked by
    ``set_forward_prefetch_layer``); ``policy_fn(tensor)`` returns ``ActivationPolicy.SAVE`` to
    keep one on the device (``CheckpointPolicy.MUST_SAVE`` / ``MUST_SWAP``, the names newer
    hyper_parallel uses, work too). Attribute access and indexing reach the wrapped module;
    ``state_dict()`` / ``named_parameters()`` carry no wrapper prefix. ``group_swap``
    (hyper_parallel's copy fusion into one staging buffer per group) is accepted and changes
    nothing: hprt's engine queues a group's copies back to back on its copy stream."""

    def __init__(self, module, policy_fn=None, manager=None, group_swap=False):
        super().__init__()
        self._swap_wrapped_module = module
        self.policy_fn = policy_fn
        self.group_swap = group_swap
        self._manager = manager if manager is not None else SwapManager()
        self._manager.wrapped += 1
        self._register_state_dict_hook(self._strip_prefix)
        self.register_load_state_dict_pre_hook(self._add_prefix)

    def forward(self, *args, **kwargs):
        region = self._manager._region(self.policy_fn)
        if region is None:
            return self._swap_wrapped_module(*args, **kwargs)
        with region:
            return self._swap_wrapped_module(*args, **kwargs)

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._swap_wrapped_module, name)

    def __getitem__(self, key):
        return self._swap_wrapped_module[key]

    def named_parameters(self, *args, **kwargs):
        for name, p in super().named_parameters(*args, **kwargs):
            yield name.replace(_WRAPPED + ".", ""), p

    @staticmethod
    def _strip_prefix(module, state_dict, prefix, *args):
        _replace_prefix(state_dict, f"{prefix}{_WRAPPED}.", prefix)
        return state_dict

    @staticmethod
    def _add_prefix(module, state_dict, prefix, *args):
        _replace_prefix(state_dict, prefix, f"{prefix}{_WRAPPED}.")


def swap_wrapper(module, policy_fn=None, group_swap=False):
    """hyper_parallel's ``swap_wrapper(module, policy_fn=None, group_swap=False)`` (a
    ``SwapWrapper``)."""
    return SwapWrapper(module, policy_fn, group_swap=group_swap)


def swap_tensor_wrapper(target, tag=None, group_swap=False):
    """hyper_parallel's ``swap_tensor_wrapper``: inside a layer's forward (a layer linked by
    ``SwapManager().set_forward_prefetch_layer``), the tensors of ``target`` (a tensor or a
    nested list / tuple / dict) join the current layer's group and are swapped in place with
    it (``SwapManager.add_storage``): their device storage is released once the group's offload
    completed and is back, same tensor objects, before the layer's backward. For tensors the
    layer's swap regions do not see (autograd saves them outside ``swap_wrapper``, or the module
    keeps them). Returns ``target`` unchanged. The last layer's group is never offloaded, so
    there it does nothing; outside a layer it warns, as hyper_parallel does. ``tag`` names
    the tensors in messages; ``group_swap`` changes nothing (see ``SwapWrapper``)."""
    manager = SwapManager()
    group = manager.get_current_group_name()
    if not group:
        if not manager.in_layer:
            warnings.warn(f"Tensor {tag} cannot be swapped, for its group is unregistered.")
        return target  # in a layer whose pass is left to autograd (no_grad, recomputation)
    if manager.is_last_group(group):
        return target
    manager.add_storage(group, target)
    return target


class CheckpointPolicy(enum.Enum):
    """hyper_parallel's selective-checkpointing policy per operator: torch's four, and
    ``MUST_SWAP`` (the output is saved, and swapped with the current layer's group)."""

    MUST_SAVE = "must_save"
    PREFER_SAVE = "prefer_save"
    MUST_RECOMPUTE = "must_recompute"
    PREFER_RECOMPUTE = "prefer_recompute"
    MUST_SWAP = "must_swap"


class CheckpointWrapper(SwapWrapper):
    """hyper_parallel's ``checkpoint_wrapper``: the wrapped module runs under torch's
    non-reentrant checkpoint with selective checkpointing, ``policy_fn(ctx, op, *args,
    **kwargs)`` choosing per operator whether its output is saved, recomputed or swapped.
    Swapped outputs are torch's SAC cache entries, routed through hprt's hooks
    (``respect_saved_tensors_hooks``) into the ``SwapManager``'s current layer group."""

    def __init__(self, module, policy_fn=None, manager=None, group_swap=False):
        super().__init__(module, self._swap_choice if policy_fn is not None else None, manager,
                         group_swap)
        self.checkpoint_policy = policy_fn
        self._swap_next = False

    def _torch_policy(self, ctx, op, *args, **kwargs):
        policy = self.checkpoint_policy(ctx, op, *args, **kwargs)
        if isinstance(policy, bool):
            policy = CheckpointPolicy.MUST_SAVE if policy else CheckpointPolicy.PREFER_RECOMPUTE
        if not isinstance(policy, CheckpointPolicy):
            raise ValueError(f"checkpoint_wrapper policy_fn returned {policy!r}, not a CheckpointPolicy")
        if not ctx.is_recompute:
            self._swap_next = policy is CheckpointPolicy.MUST_SWAP
        name = "MUST_SAVE" if policy is CheckpointPolicy.MUST_SWAP else policy.name
        return torch.utils.checkpoint.CheckpointPolicy[name]

    def _swap_choice(self, t):
        """The pack hook's choice for a tensor SAC caches: the policy of the op that made it."""
        return ActivationPolicy.SWAP if self._swap_next else ActivationPolicy.SAVE

    def forward(self, *args, **kwargs):
        from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

        options = {}
        if self.checkpoint_policy is not None:
            options = dict(
                context_fn=lambda: create_selective_checkpoint_contexts(self._torch_policy),
                respect_saved_tensors_hooks=True)
        region = self._manager._region(self.policy_fn) if self.policy_fn is not None else None
        with region if region is not None else contextlib.nullcontext():
            return checkpoint(self._swap_wrapped_module, *args, use_reentrant=False, **options,
                              **kwargs)


def checkpoint_wrapper(module, policy_fn=None, group_swap=False):
    """hyper_parallel's ``checkpoint_wrapper(module, policy_fn=None, group_swap=False)`` (a
    ``CheckpointWrapper``); without ``policy_fn`` the module is checkpointed whole."""
    return CheckpointWrapper(module, policy_fn, group_swap=group_swap)
