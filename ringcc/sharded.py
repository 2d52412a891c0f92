"""Sequence-carrying graph outputs: this rank's shard, gathered when something reads it.

Note [Sharded outputs]
A compiled graph whose output carries the sequence (a causal LM's logits [b, n, V], its
hidden states, the keys and values in a returned K/V cache) would hold all n tokens on every
rank if it gathered them: at n = V = 128K in bf16 that is 32 GiB per rank for the logits
alone, for as long as the caller keeps the output object. So, unless
Config(gather_outputs=True), the graph returns its shards and the backend hands the caller a
`SequenceSharded` tensor for each:
- Its metadata is the global value's (shape [b, n, V], dtype, device, requires_grad): code
  that reads shapes (`out.logits.shape[1]`, a cache's `get_seq_length()`) sees the model's
  n, as eager.
- It holds only this rank's rows (`.local`, in the graph's layout: contiguous, or zigzag
  where rank r holds chunks r and 2p-1-r of 2p; `.positions()` gives their global token
  positions). Its order is part of the object: no torch op ever sees the shard as if it were
  a contiguous slice of the sequence.
- Any torch op on it (indexing `out.logits[:, -1]`, `F.cross_entropy(out.logits.flatten(0, 1),
  labels.flatten())`, a mean over the sequence, printing) first gathers the full value with
  `ringcc::gather` (`.full_tensor()`; autograd flows back into the shard: the gather's
  backward keeps this rank's rows of the cotangent), caches it in the object, and runs the
  op on it. The result is an ordinary tensor, equal to eager's, gradients included.
- The gather is a collective: every rank must read the value (as every rank runs the same
  training loop). A rank that reads it alone waits for the others.
- A value that nobody reads (the K/V cache of a training step, the logits when the loss is
  computed inside from `labels=`) is never gathered: the step's memory stays O(n/p), and the
  memory plan of the graph, which ends at its outputs, counts n/p rows for each.
A shard holding rows outside the value's window (`logits[:, :-1]`, or padded rows under
Config(pad=True)) carries the window (`front`, `back`: rows of the padded global order
before and after it); the gather narrows to it. An output that merges the batch into the
sequence dim (a mixture-of-experts layer's router logits, [b * n, experts]) holds each batch
row's shard in turn (`outer` = b): its gather splits the batch rows off, gathers each row's
tokens and merges them again.
Read inside another graph that ringcc compiles (the next block of a model that dynamo breaks
into graphs), the gather is traced into that graph, whose sharding pass takes the shard as is
when the layouts and lengths agree (`handoff_gathers`): no rows move. Dynamo models the wrapper
as a plain Python object and cannot call a C method on it (`x.float()`, `x.mean(-1)`), so every
Tensor method is also a Python method of the class, which dynamo inlines.

Note [Sharded outputs and autograd]
Every path from a use of the wrapper to `.local` is one autograd function in each direction:
- a torch op reads the gathered value, `ringcc::gather` of `.local` (backward: this rank's rows
  of the cotangent); a graph that reads the wrapper traces that gather and takes the shard as is;
- the wrapper itself is the output of `_FromLocal` applied to `.local`, so it is no leaf: code
  that records the wrapper as it is (`autograd.Function.apply` records its tensor inputs, as
  FSDP2's post-backward identity does on a block's inputs, without any __torch_function__ call)
  hands its gradient, a cotangent of the global value, to `_FromLocal`'s backward, which keeps
  this rank's rows (the gather's backward again; rows outside the window get zeros).
So no gradient stops at the wrapper, whichever hook, wrapper or rewrap sits between two uses.

Note [Sharded outputs under FSDP2]
FSDP2 touches each block's inputs and outputs outside the graphs, and each touch would gather:
- its pre-backward hook, `output.register_hook(state._pre_backward)`, only needs to fire when
  the output's gradient arrives; it is registered on `.local`, whose gradient arrives then;
- its post-backward identity function, applied to a block's inputs, must see the tensors the
  block reads; it is applied to the shards, which are wrapped again (`fsdp_hooks_take_shards`,
  called by the backend when it compiles a graph of an FSDP2 module). Applied to the wrapper
  itself (a tree the registration does not reach), its output is the gathered value and its
  gradient reaches the shard through the wrapper (Note [Sharded outputs and autograd]);
- its input cast reads `torch.is_floating_point` and `.dtype`: metadata.
So activations cross FSDP2's block boundaries as shards, in both directions.

Note [Mask outputs]
A graph break between a mask's construction and the attention that reads it (transformers'
MoE layers break the graph inside a decoder layer; the next layer's attention is in a later
graph) makes the mask a graph output and an input of the later graph: a dense [b, 1, n, n] on
every rank, which the later graph could only read as data. A graph output [.., n, n], bool or
an additive mask of 0 and at most -1e4, that the graph computes as a function of its indices
and per-token tensors (Note [Mask extraction] in passes/extract_mask.py) leaves the graph as
that function instead: the graph returns the function's per-token tensors (`lift_masks` puts
them among its outputs, each replicated or, when the sharding pass makes it one, a
SequenceSharded output), and the backend hands the caller a `MaskFunctionOutput` at the mask's
place:
- its metadata is the mask's (shape, dtype, device); it holds the text of the function that
  gives its values, and the function's tensors. Under dynamic shapes (dynamic=True, or dynamo's
  automatic dynamic after a length changes) the graph knows the mask's size as an expression
  in the symbols of its inputs' sizes; the backend evaluates it with each call's inputs, so the
  wrapper's shape is the call's, and the later graph, which dynamo compiles with symbolic sizes
  too, reads it as symbols;
- any torch op on it first materialises the dense mask (`ringcc::mask_from_fn`, cached), so
  code outside a graph reads the same values as eager;
- a later graph that reads it traces that op (its Tensor methods are Python methods, as
  SequenceSharded's), whose node the passes read as the function (extract_mask): the later
  graph's attention sites take the function and its tensors, and no [n, n] value is built.
"""

from __future__ import annotations

import torch

from ringcc import _compat
from ringcc.runtime import layout as L
from ringcc.runtime.ops import gather_op, mask_from_fn_op, shard_op

_TREE = _compat.pytree()  # tree_map, tree_flatten, tree_unflatten (on __torch_function__'s path)

class SequenceSharded(torch.Tensor):
    """A sequence-sharded graph output (Note [Sharded outputs]): global metadata, this rank's
    rows, gathered (with autograd, once per grad mode) by the first op that reads it."""

    local: torch.Tensor
    seq_dim: int
    seq_layout: str
    front: int
    back: int
    outer: int  # batch rows merged in front of the sequence in seq_dim ([b * n, ...]), each sharded

    @staticmethod
    def __new__(cls, local: torch.Tensor, seq_dim: int, group_name: str, world_size: int, layout: str,
                front: int = 0, back: int = 0, outer: int = 1):
        # one autograd function from `.local` to the wrapper (Note [Sharded outputs and autograd])
        return _FromLocal.apply(local, (cls, seq_dim, group_name, world_size, layout, front, back, outer))

    @classmethod
    def _make(cls, local: torch.Tensor, seq_dim: int, group_name: str, world_size: int, layout: str,
              front: int, back: int, outer: int) -> "SequenceSharded":
        shape = list(local.shape)
        shape[seq_dim] = (shape[seq_dim] // outer * world_size - front - back) * outer
        strides = torch.empty(shape, device="meta").stride()
        self = _compat.make_wrapper_subclass(cls, shape, strides=strides, dtype=local.dtype, device=local.device)
        self.local, self.seq_dim, self.seq_layout = local, seq_dim, layout
        self._comm = (group_name, world_size)
        self.front, self.back, self.outer = front, back, outer
        self._full: dict[bool, torch.Tensor] = {}
        return self

    def __init__(self, *args, **kwargs):
        pass

    def __repr__(self, *, tensor_contents=None):
        merged = f", batch rows merged={self.outer}" if self.outer > 1 else ""
        return (f"SequenceSharded(shape={tuple(self.shape)}, seq_dim={self.seq_dim}, seq_layout={self.seq_layout!r}, "
                f"world_size={self._comm[1]}, local rows={self.local.shape[self.seq_dim]}{merged})")

    def full_tensor(self) -> torch.Tensor:
        """The whole value on every rank (a collective), cached: under autograd it is the
        differentiable gather of `.local`."""
        if torch.compiler.is_compiling():
            return self._gather()  # traced into a graph, where ringcc takes the shard as is
        grad = torch.is_grad_enabled() and self.local.requires_grad
        if grad not in self._full:
            self._full[grad] = self._gather()
        return self._full[grad]

    def _gather(self) -> torch.Tensor:
        d, local = self.seq_dim, self.local
        if self.outer > 1:  # [b * n/p, ...] -> [b, n/p, ...]: each batch row's tokens gathered
            local, d = local.unflatten(d, (self.outer, -1)), d + 1
        full = gather_op(local, d, *self._comm, self.seq_layout)
        if self.front or self.back:
            full = full.narrow(d, self.front, self.shape[self.seq_dim] // self.outer)
        return full.flatten(d - 1, d) if self.outer > 1 else full

    def with_local(self, local: torch.Tensor) -> "SequenceSharded":
        """The same global value's wrapper around other rows of this rank (same layout)."""
        return SequenceSharded(local, self.seq_dim, *self._comm, self.seq_layout, self.front, self.back, self.outer)

    def positions(self) -> torch.Tensor:
        """The global token position of each of `.local`'s rows (padded rows and rows outside
        the window: positions outside [0, shape[seq_dim] / outer)); with batch rows merged into
        the dim, the positions within each batch row, repeated for every batch row."""
        from ringcc.runtime.ops import _group_from

        _, rank, world = _group_from(*self._comm)
        rows = self.local.shape[self.seq_dim] // self.outer
        pos = L.global_positions(rank, world, L.Layout(self.seq_layout), rows, self.local.device) - self.front
        return pos.repeat(self.outer)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _compat.is_fsdp_pre_backward_hook(func, args):
            # a trigger that returns its gradient as is: on the shard, it fires when the
            # output's gradient rows of this rank arrive (Note [Sharded outputs under FSDP2])
            return args[0].local.register_hook(*args[1:], **kwargs)
        return _metadata_or_full(func, args, kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        # Every torch-level call goes through __torch_function__ and sees the gathered value;
        # reaching the dispatcher with the wrapper itself means a kernel would read a tensor
        # that has no data: refuse rather than compute a wrong value.
        raise TypeError(
            f"ringcc: {func} reached a SequenceSharded output below torch's Python API; call "
            f".full_tensor() first (the gathered value, with autograd) or use .local (this rank's rows)")


class _FromLocal(torch.autograd.Function):
    """`.local` -> its SequenceSharded wrapper (Note [Sharded outputs and autograd]): the wrapper's
    own gradient, a cotangent of the global value, reaches `.local` as this rank's rows of it."""

    @staticmethod
    def forward(ctx, local, meta):
        cls, seq_dim, group_name, world_size, layout, front, back, outer = meta
        ctx.layout = (seq_dim, (group_name, world_size), layout, front, back, outer)
        return cls._make(local, *meta[1:])

    @staticmethod
    def backward(ctx, grad):
        return _rows(grad, *ctx.layout), None


def _rows(grad, dim: int, comm: tuple[str, int], layout: str, front: int, back: int, outer: int) -> torch.Tensor:
    """This rank's rows of a cotangent of a wrapper's global value: the backward of its gather
    (rows outside the window get zeros)."""
    if outer > 1:
        grad, dim = grad.unflatten(dim, (outer, -1)), dim + 1
    if front or back:
        grad = torch.nn.functional.pad(grad, [0, 0] * (grad.dim() - 1 - dim) + [front, back])
    rows = shard_op(grad.contiguous(), dim, *comm, layout)
    return rows.flatten(dim - 1, dim) if outer > 1 else rows


class MaskFunctionOutput(torch.Tensor):
    """A mask graph output held as its mask function (Note [Mask outputs]): the mask's
    metadata, the function's text and per-token tensors, materialised by the first op that
    reads it."""

    mask_fn: str
    tensors: tuple

    @staticmethod
    def __new__(cls, mask_fn: str, shape, dtype: torch.dtype, tensors: tuple, device):
        strides = torch.empty(shape, device="meta").stride()
        self = _compat.make_wrapper_subclass(cls, shape, strides=strides, dtype=dtype, device=device)
        self.mask_fn, self.tensors = mask_fn, tuple(tensors)
        self._dense = None
        return self

    def __init__(self, *args, **kwargs):
        pass

    def __repr__(self, *, tensor_contents=None):
        return f"MaskFunctionOutput(shape={tuple(self.shape)}, dtype={self.dtype}, tensors={len(self.tensors)}, mask_fn={self.mask_fn!r})"

    def full_tensor(self) -> torch.Tensor:
        """The dense mask (cached outside a graph; traced into one, read as the function)."""
        if torch.compiler.is_compiling():
            return self._materialize()
        if self._dense is None:
            self._dense = self._materialize()
        return self._dense

    def _materialize(self) -> torch.Tensor:
        return mask_from_fn_op(self.mask_fn, list(self.shape), self.dtype, self.device, *self.tensors)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return _metadata_or_full(func, args, kwargs or {})

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise TypeError(f"ringcc: {func} reached a MaskFunctionOutput below torch's Python API; call .full_tensor() "
                        "first (the dense mask)")


def _full(x):
    return x.full_tensor() if isinstance(x, (SequenceSharded, MaskFunctionOutput)) else x


def _metadata_or_full(func, args, kwargs):
    """A wrapper's __torch_function__: a metadata query answered by the wrapper itself (shape,
    dtype, ...: _METADATA), any other op on the full values."""
    if func in _METADATA:
        with _compat.no_torch_function_subclass():
            return func(*args, **kwargs)
    return _on_full(func, args, kwargs)


def _on_full(func, args, kwargs):
    args, kwargs = _TREE.tree_map(_full, (args, kwargs))
    return func(*args, **kwargs)


def _method(name: str):
    """Tensor.<name> as a Python method of SequenceSharded: dynamo inlines it (it models the
    wrapper as a plain object, whose C methods it cannot call), so a graph that reads another
    graph's sharded output traces the gather of `.local` (Note [Sharded outputs])."""
    func = getattr(torch.Tensor, name)

    def method(self, *args, **kwargs):
        return _on_full(func, (self, *args), kwargs)

    method.__name__ = method.__qualname__ = name
    return method


def _post_backward_on_shards(register):
    """FSDP2's post-backward registration applied to the shards of sharded inputs: its identity
    function's outputs are this rank's rows, wrapped again (Note [Sharded outputs under FSDP2])."""

    def registration(args, kwargs):
        flat, spec = _TREE.tree_flatten((args, kwargs))
        sharded = {i: x for i, x in enumerate(flat) if isinstance(x, SequenceSharded)}
        if not sharded:
            return register(args, kwargs)
        args, kwargs = _TREE.tree_unflatten([sharded[i].local if i in sharded else x for i, x in enumerate(flat)], spec)
        args, kwargs = register(args, kwargs)
        flat, spec = _TREE.tree_flatten((args, kwargs))
        return _TREE.tree_unflatten([sharded[i].with_local(x) if i in sharded else x for i, x in enumerate(flat)], spec)

    return registration


def fsdp_hooks_take_shards(module) -> None:
    """Let the FSDP2 modules of `module`'s tree pass sharded inputs to their post-backward hooks
    as shards (no gather at block boundaries). Called when the backend compiles a graph of an
    FSDP2 module."""
    for group in _compat.fsdp_param_groups_in_tree(module):
        _compat.wrap_fsdp_post_backward_registration(group, _post_backward_on_shards)


_T = torch.Tensor
_METADATA = {
    _T.shape.__get__, _T.dtype.__get__, _T.device.__get__, _T.ndim.__get__, _T.layout.__get__,
    _T.requires_grad.__get__, _T.is_cuda.__get__, _T.is_sparse.__get__, _T.is_quantized.__get__,
    _T.is_meta.__get__, _T.size, _T.dim, _T.ndimension, _T.numel, _T.nelement, _T.__len__,
    _T.is_floating_point, _T.is_complex, _T.element_size, _T.get_device, torch.is_floating_point,
    torch.is_complex, torch.numel,
    _T._base.__get__,  # None: the wrapper is no view (FSDP2 checks module outputs for views)
    _T.grad_fn.__get__, _T.is_leaf.__get__,  # the wrapper's own: _FromLocal's (Note [Sharded outputs and autograd])
}


# the class's own methods are skipped by name below; these are Tensor's that must not be generated
_NOT_METHODS = {"__getattribute__", "__setattr__", "__delattr__", "__dir__", "__reduce_ex__", "__reduce__",
                "__deepcopy__", "__setstate__", "__getstate__", "__init_subclass__", "__subclasshook__", "__class__",
                "__sizeof__", "__format__", "__hash__", "__eq__", "__ne__", "__bool__", "__array__", "__array_wrap__",
                "__index__", "__int__", "__float__", "__complex__", "__iter__", "__contains__", "__len__",
                "register_hook", "backward", "__dlpack__", "__dlpack_device__", "__reversed__"}
for _cls in (SequenceSharded, MaskFunctionOutput):
    for _name, _attr in {**_compat.tensor_base_attributes(), **vars(torch.Tensor)}.items():  # public methods, operators
        if (callable(_attr) and _attr not in _METADATA and _name not in _NOT_METHODS and _name not in vars(_cls)
                and (not _name.startswith("_") or _name.startswith("__"))
                and type(_attr).__name__ in ("method_descriptor", "wrapper_descriptor", "function")):
            setattr(_cls, _name, _method(_name))


def wrap_outputs(outputs, specs: dict, group_name: str, world_size: int, layout: str, masks: tuple | None = None):
    """The graph's outputs with the sharded ones (index -> (dim, front, back, outer)) wrapped,
    then, with `masks` = (the graph's own output count, {index: (text, shape, dtype, positions of
    the function's tensors among the outputs after the own ones)}), each mask output as its
    function (Note [Mask outputs]) and those trailing tensors dropped."""
    out = list(outputs)
    for i, (dim, front, back, outer) in specs.items():
        if isinstance(out[i], torch.Tensor):
            out[i] = SequenceSharded(out[i], dim, group_name, world_size, layout, front, back, outer)
    if masks is not None:
        own, functions = masks
        for i, (text, shape, dtype, where) in functions.items():
            out[i] = MaskFunctionOutput(text, shape, dtype, tuple(out[j] for j in where), out[i].device)
        out = out[:own]
    return type(outputs)(out) if isinstance(outputs, tuple) else out
