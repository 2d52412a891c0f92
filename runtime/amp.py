"""The attention ops under torch.autocast: scaled_dot_product_attention's policy.

Note [Attention under autocast]
SDPA is on autocast's lower-precision list on CPU and CUDA: under `torch.autocast(device, dtype)`
its floating-point inputs other than fp64 are cast to `dtype` (bf16 or fp16), and it runs and
returns in that dtype. A RoPE model under autocast hands it q and k in fp32 (the rotation
multiplies the bf16 projections by fp32 cos/sin) and v in bf16: SDPA's casts make them one dtype.
The ring and dilated ops take the same policy wherever they meet autocast:
- in compiled graphs (the backend and `ringcc rewrite`), the rewrite reads the autocast state
  at each site, as the trace ran (passes/attention_form.py, `autocast_states`), and inserts the
  casts as graph nodes: the op sees one dtype, and the graph's fake values say which;
- the functional API (`ring_attention`, `dilated_attention`) casts q, k, v before its checks;
- the ops' own autocast kernels (`register_autocast`) cast when an op itself is called under
  autocast: a saved program run under autocast, a direct torch.ops.ringcc call.
The casts are ordinary differentiable casts: the gradients flow back in the inputs' dtypes, as
they do through autocast's casts. Only q, k and v are cast: key masks, ALiBi slopes (fp32 inside
the kernels) and the LSE keep their dtypes. An input already in the autocast dtype, or in fp64,
is left as it is (autocast's own rule).
"""

from __future__ import annotations

from typing import Optional

import torch

from ringcc import _compat

# The device types whose autocast lists put SDPA on the lower-precision list (checked on CPU
# by tests/test_autocast.py) and that the runtime runs on.
AUTOCAST_DEVICES = ("cpu", "cuda")
CAST_ARGS = ("q", "k", "v")


def eligible(dtype: torch.dtype) -> bool:
    """Whether autocast casts a tensor of this dtype (floating point other than fp64)."""
    return dtype.is_floating_point and dtype != torch.float64


def cast_dtype(dtype: torch.dtype, autocast_dtype: Optional[torch.dtype]) -> torch.dtype:
    """The dtype a q/k/v of `dtype` has after SDPA's autocast cast to `autocast_dtype` (None:
    autocast is off)."""
    return autocast_dtype if autocast_dtype is not None and eligible(dtype) else dtype


def autocast_dtype(device_type: str) -> Optional[torch.dtype]:
    """The dtype SDPA's inputs are cast to on `device_type` right now, or None when autocast is
    off there."""
    if device_type not in AUTOCAST_DEVICES or not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)


def cast_qkv(q, k, v):
    """q, k, v as SDPA would take them under the autocast state of q's device."""
    dt = autocast_dtype(q.device.type) if isinstance(q, torch.Tensor) else None
    if dt is None:
        return q, k, v
    return tuple(t.to(dt) if isinstance(t, torch.Tensor) and t.dtype != cast_dtype(t.dtype, dt) else t
                 for t in (q, k, v))


_LIB = torch.library.Library("ringcc", "FRAGMENT")


def register_autocast(name: str) -> None:
    """Autocast kernels for the custom op ringcc::`name` (whose first three arguments are q, k,
    v) on AUTOCAST_DEVICES: under autocast, q, k and v are cast as SDPA's are, then the op runs
    below autocast."""
    overload = getattr(torch.ops.ringcc, name).default
    for device_type in AUTOCAST_DEVICES:
        _LIB.impl(name, _kernel(overload, device_type), "Autocast" + ("CPU" if device_type == "cpu" else "CUDA"))


def _kernel(overload, device_type: str):
    def kernel(*args, **kwargs):
        dt = torch.get_autocast_dtype(device_type)
        args = [_cast(a, dt, device_type) if i < len(CAST_ARGS) else a for i, a in enumerate(args)]
        with _compat.below_autocast(device_type):
            return overload(*args, **kwargs)

    return kernel


def _cast(t, dt: torch.dtype, device_type: str):
    if isinstance(t, torch.Tensor) and t.device.type == device_type and t.dtype != cast_dtype(t.dtype, dt):
        return t.to(dt)
    return t
