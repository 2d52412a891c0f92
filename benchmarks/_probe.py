import os, torch, torch.distributed as dist, time
os.environ.setdefault("MASTER_ADDR", "127.0.0.1"); os.environ.setdefault("MASTER_PORT", "29511")
dist.init_process_group("nccl", rank=0, world_size=1)
torch.cuda.set_device(0)
from ringcc import _compat
from ringcc.runtime import ops
n, h, d = 32768, 16, 128
q, k, v, dout = (torch.randn(1, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
for t in (q, k, v): t.requires_grad_()
doc = (torch.arange(n, device="cuda") // (n // 8))[None]
TEXT = "maskfn v1 tensors=1\n%0 = load t0 b q\n%1 = load t0 b kv\n%2 = eq %0 %1\nreturn %2"
g = _compat.group_name(dist.group.WORLD)
def step():
    out = ops.ring_attention_op(q, k, v, None, True, d ** -0.5, g, 1, "contiguous", 0, None, 0.0, None, None, TEXT, doc)[0]
    out.backward(dout)
for _ in range(3): step()
torch.cuda.synchronize()
t0 = time.perf_counter(); step(); torch.cuda.synchronize(); print("step ms", (time.perf_counter() - t0) * 1e3)
from torch.profiler import profile, ProfilerActivity
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    step(); torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60))
print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=60))
