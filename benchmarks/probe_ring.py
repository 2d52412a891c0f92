"""Quick probe (not the harness): ring attention fwd+bwd per-GPU TFLOP/s vs single-GPU cuDNN
SDPA at the same total length, on every visible GPU. Prints one line per cell.
Usage: python benchmarks/probe_ring.py [n_total ...]"""

import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _time(fn, reps=5, warm=2):
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b))
    return sorted(ts)[len(ts) // 2]


def flops(n, h, d, causal):
    return 4 * n * n * h * d * (0.5 if causal else 1.0) * 3.5


def worker(rank, world, port, lengths, q):
    import ringcc
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    h, d = 16, 128
    for n in lengths:
        for causal in (False, True):
            layout = "zigzag" if causal else "contiguous"
            s = n // world
            qq, kk, vv = (torch.randn(1, h, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
            do = torch.randn_like(qq)

            def step():
                out = ringcc.ring_attention(qq, kk, vv, is_causal=causal, layout=layout)
                out.backward(do)

            torch.cuda.reset_peak_memory_stats()
            ms = _time(step)
            for skip in ("1",):
                os.environ["RINGCC_SKIP_COMM"] = skip
                ms_nc = _time(step)
                os.environ["RINGCC_SKIP_COMM"] = "0"
            peak = torch.cuda.max_memory_allocated() / 2**20
            base = None
            if rank == 0:
                qf, kf, vf = (torch.randn(1, h, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
                dof = torch.randn_like(qf)
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    base = _time(lambda: torch.nn.functional.scaled_dot_product_attention(qf, kf, vf, is_causal=causal).backward(dof))
                del qf, kf, vf, dof
            if rank == 0:
                tf = flops(n, h, d, causal) / world / (ms * 1e-3) / 1e12
                tb = flops(n, h, d, causal) / (base * 1e-3) / 1e12
                q.put(f"p={world} n={n} causal={causal}: ring {ms:.2f} ms ({tf:.0f} TF/s/GPU), no-comm {ms_nc:.2f} ms, "
                      f"cudnn-1gpu {base:.2f} ms ({tb:.0f} TF/s) eff={tf / tb:.1%} peak={peak:.0f} MiB")
            dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    lengths = [int(x) for x in sys.argv[1:]] or [32768, 131072]
    world = torch.cuda.device_count()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    mp.start_processes(worker, args=(world, 29511, lengths, q), nprocs=world, start_method="spawn", join=True)
    while not q.empty():
        print(q.get())
