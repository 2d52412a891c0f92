"""Every private torch import ringcc needs, in one place, gated by version (2.11 and 2.13)."""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.distributed as dist

TORCH_VERSION = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])


def resolve_group(name: str):
    """ProcessGroup for a group name (names are process-local; WORLD is usually "0")."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)


def group_name(group) -> str:
    """The name a custom op can carry for `group` (None = WORLD)."""
    if group is None:
        group = dist.group.WORLD
    return group.group_name


def set_group_timeout(group, timeout) -> None:
    """Make `timeout` (a timedelta) the timeout of every later operation on `group` (None = WORLD):
    torch's private `_set_pg_timeout` (gloo: its contexts' timeout; NCCL: the watchdog's)."""
    from torch.distributed.distributed_c10d import _set_pg_timeout

    _set_pg_timeout(timeout, group)


def size_hint(sym) -> int:
    """Concrete hint for a SymInt (or int) without installing a guard."""
    if isinstance(sym, int):
        return sym
    node = sym.node
    shape_env = node.shape_env
    if hasattr(shape_env, "optimization_hint"):  # 2.13
        return int(shape_env.optimization_hint(node.expr))
    return int(shape_env.size_hint(node.expr))  # 2.11


# Per-block attention kernels that return the natural-log logsumexp.
aten = torch.ops.aten
cpu_flash_fwd = aten._scaled_dot_product_flash_attention_for_cpu.default
cpu_flash_bwd = aten._scaled_dot_product_flash_attention_for_cpu_backward.default
cuda_flash_fwd = aten._scaled_dot_product_flash_attention.default
cuda_flash_bwd = aten._scaled_dot_product_flash_attention_backward.default
cuda_cudnn_fwd = aten._scaled_dot_product_cudnn_attention.default
cuda_cudnn_bwd = aten._scaled_dot_product_cudnn_attention_backward.default


# PyTorch context parallel, the peer that benchmarks/ measures against. Its code moved into
# _context_parallel/ (2.9+); `_attention` still re-exports these names in 2.11 and 2.13.
def context_parallel_api():
    """(context_parallel, set_rotate_method, cp_options) of torch's experimental context parallel."""
    from torch.distributed.tensor.experimental import context_parallel

    try:
        from torch.distributed.tensor.experimental._attention import _cp_options, set_rotate_method
    except ImportError:
        from torch.distributed.tensor.experimental._context_parallel._attention import (
            _cp_options,
            set_rotate_method,
        )
    return context_parallel, set_rotate_method, _cp_options


def raise_recompile_limit(limit: int) -> None:
    """Let dynamo keep at least `limit` compiled variants of one function (a benchmark compiles
    flex_attention once per shape and mask; past the default limit it would silently run eager)."""
    import torch._dynamo.config as dynamo_config

    name = "recompile_limit" if hasattr(dynamo_config, "recompile_limit") else "cache_size_limit"
    setattr(dynamo_config, name, max(getattr(dynamo_config, name), limit))


@contextlib.contextmanager
def autograd_inside_op():
    """Autograd recording inside a custom op's kernel, which runs with the autograd dispatch
    keys excluded (torch.enable_grad alone records nothing there): flex.py traces a score
    function's joint graph inside the ring's backward op."""
    keys = torch._C.DispatchKeySet(torch._C.DispatchKey.AutogradFunctionality) | torch._C.DispatchKeySet(
        torch._C.DispatchKey.ADInplaceOrView)
    included, excluded = torch._C._dispatch_tls_local_include_set(), torch._C._dispatch_tls_local_exclude_set()
    with torch._C._ForceDispatchKeyGuard(included, excluded - keys), torch.enable_grad():
        yield


@contextlib.contextmanager
def flex_cpu_backward():
    """flex_attention on CPU with inputs that need a gradient: its public entry refuses them
    (only its CUDA kernels are meant for training), while its own dense implementation has the
    backward. CPU tests run the CUDA path's flex blocks (runtime/flex.py) with it."""
    import torch.nn.attention.flex_attention as fa

    check = fa._validate_device
    fa._validate_device = lambda q, k, v: None
    try:
        yield
    finally:
        fa._validate_device = check


def flex_backward_op():
    """(flex_attention's backward higher-order op, its builder of the score function's forward
    and joint graphs): runtime/flex.py calls the backward kernel with the rows' global (out,
    lse) (Note [Flex blocks]). Private in torch 2.11 and 2.13, with the same signatures. The
    graphs are traced as flex traces its functions: t[i] with a tensor index is an index op."""
    from torch._dynamo._trace_wrapped_higher_order_op import TransformGetItemToIndex
    from torch._higher_order_ops.flex_attention import create_fw_bw_graph, flex_attention_backward

    def graphs(score_mod, example, tensors):
        with TransformGetItemToIndex():
            return create_fw_bw_graph(score_mod, example, tensors)

    return flex_attention_backward, graphs


_SCHEMA_ARGUMENTS: dict = {}  # schema -> its arguments (linear_fill_defaults; one entry per op overload that ran)


def _fill_defaults_linear(schema, args, kwargs):
    arguments = _SCHEMA_ARGUMENTS.get(schema)
    if arguments is None:
        if not schema.name.startswith("ringcc::"):  # other libraries' ops: torch's own, as it is
            return TORCH_FILL_DEFAULTS(schema, args, kwargs)
        arguments = _SCHEMA_ARGUMENTS[schema] = tuple(schema.arguments)
    new_args, new_kwargs = [], {}
    for i, info in enumerate(arguments):
        if info.kwarg_only:
            new_kwargs[info.name] = kwargs[info.name] if info.name in kwargs else info.default_value
        else:
            new_args.append(args[i] if i < len(args) else info.default_value)
    return tuple(new_args), new_kwargs


TORCH_FILL_DEFAULTS = None  # torch's own fill_defaults, once replaced (for the comparison in tests)


def linear_fill_defaults() -> None:
    """Install `_fill_defaults_linear` as torch's custom-op fill_defaults; once, and only where
    torch has that function (2.11, 2.13).

    A custom op's autograd kernel (torch.library register_autograd) completes the call's
    arguments with the schema's defaults before it calls setup_context: torch's
    torch._library.utils.fill_defaults reads `schema.arguments` once per argument, and each read
    builds the whole list of arguments anew in C++. The ring op has 23 arguments: about 530 list
    entries per call, 0.2-0.35 ms per forward on a CPU host. `_fill_defaults_linear` reads the
    list once per schema (kept, as the Argument objects; each default is read from them at each
    call, as torch does) and gives the same (args, kwargs) in linear time. Installed when
    ringcc's ops are registered (runtime/ops.py), it serves ringcc's ops and hands every other
    op to torch's own; tests/test_ring.py compares it with torch's own on every ringcc op."""
    global TORCH_FILL_DEFAULTS
    from torch._library import utils

    current = getattr(utils, "fill_defaults", None)
    if current is None or current is _fill_defaults_linear:
        return
    TORCH_FILL_DEFAULTS = current
    utils.fill_defaults = _fill_defaults_linear


_FLEX_KERNEL_OPTIONS: dict = {}


def flex_kernel_options(q, k, v, given: tuple = ()) -> tuple:
    """The kernel options flex_attention's entry completes for a call that returns its lse, from
    the `given` ones ((name, value) pairs), as sorted (name, value) pairs: its kernels read every
    one of them, and the higher-order ops are called past that entry. In 2.11 and 2.13 they depend
    on the inputs' device types and the given options alone: made once per such key."""
    key = (q.device.type, k.device.type, v.device.type, given)
    options = _FLEX_KERNEL_OPTIONS.get(key)
    if options is None:
        from torch.nn.attention.flex_attention import _apply_kernel_options

        options = _FLEX_KERNEL_OPTIONS[key] = tuple(sorted(_apply_kernel_options(q, k, v, True, dict(given)).items()))
    return options


def flex_forward_op():
    """flex_attention's forward higher-order op: (q, k, v, score_mod, block_mask tuple, scale,
    kernel options, score_mod's tensors, mask_mod's tensors) -> (out, lse in base 2, ...) (private
    in torch 2.11 and 2.13, with that signature)."""
    from torch._higher_order_ops.flex_attention import flex_attention

    return flex_attention


def trace_fake(fn, args) -> torch.fx.GraphModule:
    """fn traced over fake copies of args (make_fx): an ATen graph, higher-order ops kept."""
    from torch.fx.experimental.proxy_tensor import make_fx

    return make_fx(fn, tracing_mode="fake")(*args)


def compile_graph(gm: torch.fx.GraphModule, example_inputs: list):
    """An ATen graph compiled by inductor for inputs like example_inputs: a callable of them."""
    from torch._inductor.compile_fx import compile_fx

    return compile_fx(gm, example_inputs)


def restart_analysis() -> type:
    """The exception by which a compiler asks dynamo to trace the frame again (AOT autograd's
    tensorify pass, specialising a float input): the graph the compiler was given never runs."""
    from torch._dynamo.exc import RestartAnalysis

    return RestartAnalysis


def compile_errors() -> tuple[type, ...]:
    """Exceptions meaning torch.compile could not build or launch a kernel here (dynamo and
    inductor failures, the recompile limit under fullgraph, Triton out of resources): a
    compiled kernel's caller may fall back to an eager path. Out-of-memory is not among them."""
    import torch._dynamo.exc as exc

    errors = [exc.TorchDynamoException]
    if hasattr(exc, "FailOnRecompileLimitHit"):
        errors.append(exc.FailOnRecompileLimitHit)
    try:
        from triton.runtime.errors import OutOfResources

        errors.append(OutOfResources)
    except ImportError:
        pass
    return tuple(errors)


def specialize_int(sym) -> int | None:
    """A SymInt's value, with a guard that it stays so (dynamo then recompiles for other values);
    None when it has no hint (an unbacked size)."""
    from torch.fx.experimental.symbolic_shapes import guard_int

    if isinstance(sym, int):
        return sym
    if not sym.node.has_hint():
        return None
    return int(guard_int(sym))


def sym_expr(sym):
    """The sympy expression of a SymInt with the shape environment's known equalities
    applied (s1 -> s0 after a guard s1 == s0), without installing a guard."""
    node = sym.node
    env = getattr(node, "shape_env", None)
    return env.replace(node.expr) if env is not None and hasattr(env, "replace") else node.expr


def statically_known_equal(a, b) -> bool:
    """a == b for sizes (ints or SymInts), proved from the shape environment's facts (value
    ranges, guards already installed) without installing a guard; False when unknown."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    if isinstance(a, int) and isinstance(b, int):
        return a == b
    return bool(statically_known_true(a == b))


def mem_tracker():
    """torch's MemTracker (a dispatch mode that records the peak of live tensor bytes on any
    device, CPU included), for checking the memory planner without a GPU."""
    from torch.distributed._tools.mem_tracker import MemTracker

    return MemTracker


def sympy_divisions():
    """The sympy functions torch writes integer division of sizes with: (FloorDiv, CeilDiv)."""
    from torch.utils._sympy.functions import CeilDiv, FloorDiv

    return FloorDiv, CeilDiv


OpOverload = torch._ops.OpOverload
OpOverloadPacket = torch._ops.OpOverloadPacket


def transformer_encoder_layer_fwd():
    """torch._transformer_encoder_layer_fwd (nn.TransformerEncoderLayer's fused inference
    path, one opaque call in dynamo graphs), or None where it does not exist."""
    return getattr(torch, "_transformer_encoder_layer_fwd", None)


def symmetric_memory():
    """torch's symmetric memory module (`empty`, `rendezvous`: peer-mapped CUDA buffers), or
    None where this build has none."""
    try:
        import torch.distributed._symmetric_memory as symm_mem
    except ImportError:
        return None
    return symm_mem


def symm_rendezvous(buf: torch.Tensor, group):
    """The symmetric-memory handle of `buf` over `group` (collective). torch 2.11 may still
    want the group registered first (deprecated, and a no-op, in later versions)."""
    import warnings

    symm_mem = symmetric_memory()
    try:
        return symm_mem.rendezvous(buf, group)
    except RuntimeError:
        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
        if enable is None:
            raise
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            enable(group.group_name)
        return symm_mem.rendezvous(buf, group)


class CudaDriver:
    """CUDA driver calls for the copy-engine ring, loaded from libcuda with ctypes: the stream
    memory operations torch does not bind for Python, cuStreamWaitValue32 (a stream waits,
    without a kernel, until a 32-bit word in device memory reaches a value) and
    cuStreamWriteValue32 (a stream writes one, after a system-wide fence); and the few
    stream calls the ring issues per batch (async copy, event record, stream wait on an event),
    which through the driver cost the host a few microseconds each instead of torch's tens
    (host time measured per call site).
    Streams are raw handles (`torch.cuda.Stream.cuda_stream`; 0 is the current device's
    default stream, so callers make their device current)."""

    WAIT_GEQ = 0x0
    EVENT_DISABLE_TIMING = 0x2

    def __init__(self):
        import ctypes

        lib = ctypes.CDLL("libcuda.so.1")
        self._ctypes = ctypes
        self._wait = getattr(lib, "cuStreamWaitValue32_v2", None) or lib.cuStreamWaitValue32
        self._write = getattr(lib, "cuStreamWriteValue32_v2", None) or lib.cuStreamWriteValue32
        for f in (self._wait, self._write):
            f.restype = ctypes.c_int
            f.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
        self._copy = lib.cuMemcpyDtoDAsync_v2
        self._copy.restype = ctypes.c_int
        self._copy.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]
        self._event_create = lib.cuEventCreate
        self._event_create.restype = ctypes.c_int
        self._event_create.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint]
        self._event_record = lib.cuEventRecord
        self._event_record.restype = ctypes.c_int
        self._event_record.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        self._wait_event = lib.cuStreamWaitEvent
        self._wait_event.restype = ctypes.c_int
        self._wait_event.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint]

    @staticmethod
    def _check(rc: int, what: str) -> None:
        if rc != 0:
            raise RuntimeError(f"{what} failed with CUDA driver error {rc}")

    def wait_geq(self, stream: int, address: int, value: int) -> None:
        self._check(self._wait(stream, address, value & 0xFFFFFFFF, self.WAIT_GEQ), "cuStreamWaitValue32")

    def write(self, stream: int, address: int, value: int) -> None:
        self._check(self._write(stream, address, value & 0xFFFFFFFF, 0), "cuStreamWriteValue32")

    def copy(self, stream: int, dst: int, src: int, nbytes: int) -> None:
        """Device-to-device copy of nbytes on `stream` (a peer's mapped address works as dst)."""
        self._check(self._copy(dst, src, nbytes, stream), "cuMemcpyDtoDAsync")

    def event(self) -> int:
        """A new event without timing, of the current device's context (never destroyed: the
        ring makes two per receive area)."""
        ev = self._ctypes.c_void_p()
        self._check(self._event_create(self._ctypes.byref(ev), self.EVENT_DISABLE_TIMING), "cuEventCreate")
        return ev.value

    def order(self, later: int, earlier: int, event: int) -> None:
        """Work queued on stream `later` from now on waits for what is queued on `earlier` now."""
        self._check(self._event_record(event, earlier), "cuEventRecord")
        self._check(self._wait_event(later, event, 0), "cuStreamWaitEvent")


def on_device(device: torch.device):
    """The CUDA device's context when it is not the current one, else nothing: Triton launches and
    raw driver calls on stream 0 act on the current device, and entering torch.cuda.device
    costs the host two device switches per call."""
    if device.type == "cuda" and device.index is not None and device.index != torch.cuda.current_device():
        return torch.cuda.device(device)
    return contextlib.nullcontext()


def triton_direct_launch() -> bool:
    """Whether Triton's compiled kernels can be launched as its own launch path does in
    Triton 3.4 and later (`triton_launch`): the CUDA backend, and `triton.knobs` (earlier
    launchers took other arguments). Note [Direct launches] in runtime/fused.py."""
    import triton

    try:
        return hasattr(triton, "knobs") and triton.runtime.driver.active.get_current_target().backend == "cuda"
    except Exception:  # noqa: BLE001 - no active driver: Triton's own path decides what to do
        return False


def triton_device_and_stream() -> tuple[int, int]:
    """(current device, its current stream's raw handle), as Triton's launch path reads them."""
    import triton

    drv = triton.runtime.driver.active
    device = drv.get_current_device()
    return device, drv.get_current_stream(device)


def triton_launch(kernel, grid, stream: int, args) -> None:
    """Launch a compiled Triton kernel (what `jit_fn[grid](*args)` returned) on a 2-D grid with
    every argument, constexprs included, as Triton's JITFunction.run does."""
    import triton

    hooks = triton.knobs.runtime
    kernel.run(grid[0], grid[1], 1, stream, kernel.function, kernel.packed_metadata,
               kernel.launch_metadata(grid, stream, *args), hooks.launch_enter_hook, hooks.launch_exit_hook, *args)


def current_raw_stream(device: torch.device) -> int:
    """The raw handle of the current stream of a CUDA device (its index, or the current device's
    when it has none), without making a torch.cuda.Stream object (a few µs of host time each):
    the private call inductor's generated code uses, else the public way."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    get = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if get is None:
        return torch.cuda.current_stream(index).cuda_stream
    return get(index)


def cuda_spin(cycles: int) -> None:
    """Keep the current CUDA stream busy for about `cycles` GPU clock cycles (torch.cuda._sleep):
    benchmarks use it to let the host run ahead of the GPU."""
    torch.cuda._sleep(int(cycles))


def record_cuda_memory_history(enabled: bool, max_entries: int = 200000) -> None:
    """Start (with Python stacks) or stop the CUDA caching allocator's event history (private
    API, the one torch's memory visualizer reads)."""
    if enabled:
        torch.cuda.memory._record_memory_history(stacks="python", max_entries=max_entries)
    else:
        torch.cuda.memory._record_memory_history(enabled=None)


def cuda_memory_snapshot() -> dict:
    """The allocator's snapshot: segments and the recorded "device_traces" (private API)."""
    return torch.cuda.memory._snapshot()


def cudagraph_unsafe_tags() -> tuple:
    """Tags for a custom op that CUDA graphs must not capture (inductor partitions its graph
    around it): torch.Tag.cudagraph_unsafe where this torch has it, else none."""
    tag = getattr(torch.Tag, "cudagraph_unsafe", None)
    return () if tag is None else (tag,)


def boxed_graph(gm: torch.fx.GraphModule, _example_inputs=None):
    """`gm` as a boxed function for AOTAutograd (one list argument, cleared on entry), so each
    input, such as a saved activation in a backward graph, is freed after its last use instead
    of living until the graph returns (what inductor's code does too; functorch's
    make_boxed_func keeps every input). FX's boxed code generator, private, present in torch
    2.11 and 2.13 (torch's own aot_eager backend uses it)."""
    from torch.fx.graph import _BoxedCodeGen

    gm.graph.set_codegen(_BoxedCodeGen())
    gm.recompile()

    def run(args):
        return gm.forward(args)

    run._boxed_call = True
    return run


def make_wrapper_subclass(cls, shape, **kwargs):
    """A tensor of class `cls` with metadata and no storage (ringcc.sharded.SequenceSharded)."""
    return torch.Tensor._make_wrapper_subclass(cls, shape, **kwargs)


def no_torch_function_subclass():
    """A context in which tensor subclasses' __torch_function__ is not called (their metadata
    is read as a plain tensor's)."""
    return torch._C.DisableTorchFunctionSubclass()


def cpu_allocation_peak(step) -> int:
    """The peak of the bytes a call of step() allocates beyond what exists before it, from the
    CPU allocator's events as torch.profiler records them (compiled code included, unlike
    dispatch modes); the events' list is the profiler's private kineto result."""
    import os

    from torch.profiler import ProfilerActivity, profile

    # kineto prints a "profiler_start" / "profiler_stop" line per profile below level 6; it
    # reads the level when a process first profiles (a setting made earlier is kept)
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    live = peak = 0
    for ev in sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                     key=lambda e: e.start_ns()):
        live += ev.nbytes()
        peak = max(peak, live)
    return peak


def _dynamo_frame_module():
    """The module whose method dynamo is compiling now (the frame's `self`), or None."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tx = InstructionTranslator.current_tx()
    except (ImportError, AttributeError):
        return None
    module = getattr(tx, "f_locals", {}).get("self") if tx is not None else None
    return module if isinstance(module, torch.nn.Module) else None


def _fsdp_param_groups(module) -> list:
    return _state_param_groups(module._get_fsdp_state())


def _state_param_groups(state) -> list:
    groups = getattr(state, "_fsdp_param_groups", None)  # 2.13: a list (fully_shard([a, b]))
    if groups is None:
        group = getattr(state, "_fsdp_param_group", None)  # 2.11
        groups = [] if group is None else [group]
    return groups


def data_parallel_means(tensors: list) -> dict[int, tuple[tuple[int, ...], bool]]:
    """The gradients that a data-parallel engine outside the graph reduces: for each tensor of
    `tensors` (a graph's example inputs) that is a parameter of DDP's module while its forward
    runs, or an unsharded parameter of an FSDP2 module within the module being compiled, its
    position -> (the global ranks the engine reduces that gradient over, whether it reduces by
    the plain mean). FSDP2 on a full SPMD mesh (dp_mesh_dims) is not read (left out)."""
    position = {id(t): i for i, t in enumerate(tensors) if isinstance(t, torch.Tensor)}
    out: dict[int, tuple[tuple[int, ...], bool]] = {}
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel._get_active_ddp_module()
    if ddp is not None:
        ranks = tuple(dist.get_process_group_ranks(ddp.process_group))
        ignored = set(getattr(ddp, "parameters_to_ignore", ()))
        for name, p in ddp.module.named_parameters():
            if name not in ignored and id(p) in position:
                out[position[id(p)]] = (ranks, True)
    module = _dynamo_frame_module()
    if module is None:
        return out
    from torch.distributed.fsdp import FSDPModule

    for m in module.modules():
        if not isinstance(m, FSDPModule):
            continue
        for group in _fsdp_param_groups(m):
            info = group.mesh_info
            if getattr(info, "is_spmd_mesh", False):
                continue
            ranks = tuple(int(r) for r in info.mesh.mesh.flatten().tolist())
            mean = getattr(group, "gradient_divide_factor", None) is None and not getattr(
                group, "force_sum_reduction_for_comms", False)
            for fp in group.fsdp_params:
                t = getattr(fp, "_unsharded_param", None)
                if t is not None and id(t) in position:
                    out[position[id(t)]] = (ranks, mean)
    return out


def is_fsdp_pre_backward_hook(func, args) -> bool:
    """Whether a torch-level call registers FSDP2's pre-backward hook on a module's output
    (`Tensor.register_hook(state._pre_backward)`): a trigger that returns its gradient as is."""
    if func is not torch.Tensor.register_hook or len(args) < 2:
        return False
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState
    except ImportError:
        return False
    return isinstance(getattr(args[1], "__self__", None), FSDPState)


def fsdp_param_groups_in_tree(module) -> list:
    """Every FSDP2 parameter group of the fully_shard tree that `module` belongs to (once its
    root has run a forward), or [] when it is no FSDP2 module."""
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(module, FSDPModule):
        return []
    states = getattr(module._get_fsdp_state()._state_ctx, "all_states", [])
    return [g for state in states for g in _state_param_groups(state)]


def wrap_fsdp_post_backward_registration(group, wrap) -> None:
    """Replace FSDP2 parameter group's `_register_post_backward_hook(args, kwargs)` (which applies
    its post-backward identity function to a module's inputs) by wrap(original), once."""
    current = group._register_post_backward_hook
    if not getattr(current, "_ringcc", False):
        group._register_post_backward_hook = wrap(current)
        group._register_post_backward_hook._ringcc = True


def release_before_destroy(release) -> None:
    """Make torch.distributed.destroy_process_group call `release()` first (once installed,
    for every later call, through `torch.distributed` and `distributed_c10d` alike).
    NCCL's communicator cannot be destroyed while a CUDA graph holding its kernels lives:
    destroy_process_group would wait forever (pytorch/pytorch#115388), so ringcc's captured
    ring ops (runtime/graphs.py) go first. A name bound before installation (`from
    torch.distributed import destroy_process_group`) keeps the original function."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    original = c10d.destroy_process_group
    if getattr(original, "_ringcc_releases", None) is not None:
        original._ringcc_releases.append(release)
        return
    releases = [release]

    @functools.wraps(original)
    def destroy_process_group(*args, **kwargs):
        for fn in releases:
            fn()
        return original(*args, **kwargs)

    destroy_process_group._ringcc_releases = releases
    c10d.destroy_process_group = destroy_process_group
    dist.destroy_process_group = destroy_process_group


def aot_autograd(**kwargs):
    """Dynamo's AOTAutograd backend maker (torch._dynamo.backends.common, private; present in
    torch 2.11 and 2.13), e.g. aot_autograd(fw_compiler=..., bw_compiler=...)."""
    from torch._dynamo.backends.common import aot_autograd as make

    return make(**kwargs)


def compile_with_inductor(gm, example_inputs, graph_pass, source_files: tuple):
    """Inductor's compile_fx of `gm`, with graph_pass(graph) run as a post-grad pass before any
    post-grad pass already configured (torch._inductor, private); its cache key covers
    `source_files`' contents."""
    from torch._inductor import config as inductor_config
    from torch._inductor.compile_fx import compile_fx

    post = _post_grad_pass(graph_pass, source_files, then=inductor_config.post_grad_custom_post_pass)
    return compile_fx(gm, example_inputs, config_patches={"post_grad_custom_post_pass": post})


def pytree():
    """torch.utils._pytree (private; tree_flatten, tree_unflatten, tree_map)."""
    from torch.utils import _pytree

    return _pytree


def tensor_base_attributes() -> dict:
    """The attributes of torch._C.TensorBase (the C class under torch.Tensor: most of its methods
    and operators), by name."""
    return dict(vars(torch._C.TensorBase))


def _post_grad_pass(fn, source_files: tuple, then=None):
    """An inductor post-grad pass (config.post_grad_custom_post_pass) that calls fn(graph), then
    `then` (a pass already set), keyed for inductor's cache by `source_files`' contents."""
    from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

    class _Pass(CustomGraphPass):
        def __call__(self, graph):
            fn(graph)
            if then is not None:
                then(graph)

        def uuid(self):
            return (get_hash_for_files(tuple(source_files)), fn.__module__, fn.__qualname__,
                    None if then is None else then.uuid())

    return _Pass()


def autocast_region_targets() -> tuple:
    """(enter, exit): the functions dynamo records for a `torch.autocast` region inside a traced
    graph, `_enter_autocast(device_type, dtype, enabled, cache_enabled)` returning the context
    that `_exit_autocast` takes (private, in 2.11 and 2.13)."""
    from torch.amp.autocast_mode import _enter_autocast, _exit_autocast

    return _enter_autocast, _exit_autocast


def below_autocast(device_type: str):
    """A context in which calls skip `device_type`'s autocast dispatch key: what an autocast
    kernel runs its op under once it has cast the inputs (torch.library.register_autocast's
    own mechanism, private)."""
    key = getattr(torch._C.DispatchKey, "Autocast" + torch._C._dispatch_key_for_device(device_type))
    return torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(key))


def vmap_batch_dim_targets() -> tuple:
    """(add, remove): the functions dynamo records where traced code calls torch.vmap,
    `_add_batch_dim(x, in_dim, level)` (x with dim in_dim hidden as vmap level `level`'s batch)
    and `_remove_batch_dim(y, level, batch_size, out_dim)` (that batch back as dim out_dim);
    private, in 2.11 and 2.13."""
    from torch._functorch.predispatch import _add_batch_dim, _remove_batch_dim

    return _add_batch_dim, _remove_batch_dim


def vmap_level_targets() -> tuple:
    """(enter, exit): the functions dynamo records where traced code enters and leaves a
    torch.vmap level, `_vmap_increment_nesting(batch_size, randomness)` and
    `_vmap_decrement_nesting()`: calls for their effect on functorch's level stack, whose results
    nothing reads (private, in 2.11 and 2.13)."""
    from torch._functorch.predispatch import _vmap_decrement_nesting, _vmap_increment_nesting

    return _vmap_increment_nesting, _vmap_decrement_nesting


def is_vmap_batched(value) -> bool:
    """Whether a traced value is one of torch.vmap's batched tensors (its shape hides the batch)."""
    return isinstance(value, torch.Tensor) and torch._C._functorch.is_batchedtensor(value)


def plain_eager(values) -> bool:
    """Whether a call with these arguments reaches its Python kernel with nothing between: no
    compile trace, no dispatch or function mode, no functorch transform, and every tensor a plain
    torch.Tensor (private: the mode stack and functorch's interpreter stack; 2.11, 2.13)."""
    return (not torch.compiler.is_compiling() and torch._C._len_torch_dispatch_stack() == 0
            and not torch._C._is_torch_function_mode_enabled()
            and torch._C._functorch.peek_interpreter_stack() is None
            and all(type(v) is torch.Tensor for v in values if isinstance(v, torch.Tensor)))
