import torch, traceback, math
from ringcc.runtime import flex, kernels
from ringcc import reference
q, k, v, dout = (torch.randn(1, 4, 512, 64, device="cuda", dtype=torch.bfloat16) for _ in range(4))
out, lse = flex.fwd(q, k, v, 0.125, True, None, None, kernels.ScoreMod(30.0))
try:
    r = flex.bwd(dout, q, k, v, out, kernels.bwd_lse(lse), 0.125, True, None, None, kernels.ScoreMod(30.0))
    print("ok", [t.shape for t in r])
except Exception as e:
    s = traceback.format_exc()
    print(s[-6000:])
