"""Host (CPU issue) time per cuDNN call: torch's op, the frontend's execute, ``_execute_with_ptrs``, the pieces of
the library's call, and its forward pattern calls at LongNet size. Tiny problems so the GPU never backs up; no sync
inside the timed loop. Needs CUDA and nvidia-cudnn-frontend.

    PYTHONPATH=. python benchmarks/probe_frontend_host.py   # results/host_frontend_h200_session14.log
"""
import time, statistics, torch
from dilated_attention.kernels.cudnn_frontend import CudnnFrontendOps, _frontend
from dilated_attention.kernels.cudnn import CudnnKernel
from dilated_attention.patterns import plan_patterns
dev = torch.device("cuda")
def host_us(fn, n=200, reps=7):
    for _ in range(20): fn()
    torch.cuda.synchronize(); res = []
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(n): fn()
        res.append((time.perf_counter() - t) / n * 1e6)
        torch.cuda.synchronize()
    return statistics.median(res)
g = torch.Generator(device=dev).manual_seed(0)
q, k, v = (torch.randn(1, 2, 128, 64, device=dev, dtype=torch.bfloat16, generator=g) for _ in range(3))
ops = CudnnFrontendOps()
res, lse4 = ops.forward(q, k, v, causal=True, scale=0.125)
tensors = (q, k, v, res, lse4)
graph, nodes, ws, _ = ops._graph(_frontend(), tensors, "forward", True, 0.125)
handle = ops._handles[0]
pack = dict(zip(nodes, tensors))
uids = graph._get_variant_pack_uids_sorted()
by_uid = {n.get_uid(): t for n, t in zip(nodes, tensors)}
wst = torch.empty(max(ws, 1), dtype=torch.uint8, device=dev)
print("workspace bytes", ws)
ptrs = [by_uid[u].data_ptr() for u in uids]
print("uids", uids, [n.get_uid() for n in nodes])
rows = {
    "torch op": lambda: torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, True, False, scale=0.125),
    "ops.forward (library)": lambda: ops.forward(q, k, v, causal=True, scale=0.125),
    "ops.forward out=": lambda: ops.forward(q, k, v, causal=True, scale=0.125, out=res),
    "ops._execute": lambda: ops._execute(tensors, "forward", True, 0.125),
    "graph.execute(dict)": lambda: graph.execute(pack, wst, handle=handle),
    "graph._execute_with_ptrs": lambda: graph._execute_with_ptrs(ptrs, wst.data_ptr(), handle),
    "ptr list build": lambda: [by_uid[u].data_ptr() for u in uids],
    "key build": lambda: (0, "forward", True, 0.125, *((x.dtype, tuple(x.shape), x.stride()) for x in tensors)),
    "detach x5": lambda: tuple(x.detach() for x in tensors),
    "empty lse4": lambda: torch.empty((1, 2, 128, 1), dtype=torch.float32, device=dev),
    "copy small": lambda: lse4.copy_(lse4),
    "current_stream": lambda: torch.cuda.current_stream(dev).cuda_stream,
}
for name, fn in rows.items():
    print(f"{name:28s} {host_us(fn):8.2f} us/call", flush=True)
# library pattern calls at LongNet size (host issue time; GPU may back up: measure issue of one step only)
B, N, H, D = 1, 32768, 16, 128
Q, K, V, DO = (torch.randn(B, N, H, D, device=dev, dtype=torch.bfloat16, generator=g) for _ in range(4))
plans = plan_patterns([2048, 4096, 8192, 16384, 32768], [1, 2, 4, 8, 16], seq_len=N, local_len=N, num_heads=H, num_kv_heads=H)
kern = CudnnKernel(CudnnFrontendOps())
for causal in (False, True):
    for p in plans:
        def f(): return kern.forward_pattern(Q, K, V, p, packed=False, causal=causal, scale=D ** -0.5)
        f(); torch.cuda.synchronize()
        ts = []
        for _ in range(7):
            torch.cuda.synchronize(); t = time.perf_counter(); f(); ts.append((time.perf_counter() - t) * 1e6)
        print(f"forward_pattern causal={causal} r={p.dilation}: host {statistics.median(ts):.1f} us", flush=True)
