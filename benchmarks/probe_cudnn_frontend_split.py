"""Probe (H200 run, `benchmarks/results/cudnn_frontend_split_h200.log`): the deterministic backward split into key chunks / batch parts
(workspace vs time), fp32 gradient outputs (refused).

Run: `pip install nvidia-cudnn-frontend==1.22.1`, then `python benchmarks/probe_cudnn_frontend_split.py` from the repo root.
"""
import os, sys, json
import torch
sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks"))
from bench_kernel import timed
import cudnn
dev = torch.device("cuda")
handle = cudnn.create_handle()
cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream().cuda_stream)
DT = {torch.bfloat16: cudnn.data_type.BFLOAT16, torch.float16: cudnn.data_type.HALF, torch.float32: cudnn.data_type.FLOAT}
CACHE = {}
def sig(x): return (tuple(x.shape), tuple(x.stride()), x.dtype)
def graph_for(q, k, v, o, do, lse4, dq, dk, dv, causal, scale, det=True):
    key = tuple(sig(x) for x in (q, k, v, o, do, lse4, dq, dk, dv)) + (causal, scale, det)
    if key not in CACHE:
        g = cudnn.pygraph(io_data_type=DT[q.dtype], intermediate_data_type=cudnn.data_type.FLOAT,
                          compute_data_type=cudnn.data_type.FLOAT, handle=handle)
        t = [g.tensor_like(x) for x in (q, k, v, o, do, lse4)]
        outs = g.sdpa_backward(q=t[0], k=t[1], v=t[2], o=t[3], dO=t[4], stats=t[5], attn_scale=scale,
                               use_causal_mask=causal, use_deterministic_algorithm=det)
        for gt, x in zip(outs, (dq, dk, dv)):
            gt.set_output(True).set_dim(list(x.shape)).set_stride(list(x.stride())).set_data_type(DT[x.dtype])
        g.validate(); g.build_operation_graph()
        g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK]); g.check_support(); g.build_plans()
        CACHE[key] = (g, t + list(outs), g.get_workspace_size())
    return CACHE[key]
def run_bwd(q, k, v, o, do, lse4, dq, dk, dv, causal, scale, det=True):
    g, ts, ws = graph_for(q, k, v, o, do, lse4, dq, dk, dv, causal, scale, det)
    w = torch.empty(ws, device=dev, dtype=torch.uint8)
    g.execute(dict(zip(ts, (q, k, v, o, do, lse4, dq, dk, dv))), w, handle=handle)
    return ws
def chunked(q, k, v, o, do, lse4, causal, scale, kc, gdt):
    M = k.shape[2]
    dq_acc = torch.zeros(q.shape, dtype=torch.float32, device=dev)
    dk_acc = torch.zeros(k.shape, dtype=torch.float32, device=dev); dv_acc = torch.zeros(v.shape, dtype=torch.float32, device=dev)
    wsmax = 0
    for k0 in range(0, M, kc):
        k1 = min(M, k0 + kc)
        q0 = k0 if causal else 0
        qs, os_, ds, ls = q[:, :, q0:], o[:, :, q0:], do[:, :, q0:], lse4[:, :, q0:]
        ks, vs = k[:, :, k0:k1], v[:, :, k0:k1]
        gq = torch.empty(qs.shape, dtype=gdt, device=dev); gk = torch.empty(ks.shape, dtype=gdt, device=dev); gv = torch.empty(vs.shape, dtype=gdt, device=dev)
        wsmax = max(wsmax, run_bwd(qs, ks, vs, os_, ds, ls, gq, gk, gv, causal, scale))
        dq_acc[:, :, q0:] += gq; dk_acc[:, :, k0:k1] += gk; dv_acc[:, :, k0:k1] += gv
    return (dq_acc, dk_acc, dv_acc), wsmax
def out(d): print(json.dumps(d), flush=True)
B, N, H, D = 1, 32768, 16, 128
torch.manual_seed(0)
for causal in (False, True):
    xs = [torch.randn(B, N, H, D, device=dev, dtype=torch.bfloat16).transpose(1, 2) for _ in range(4)]
    q, k, v, do = xs; scale = D ** -0.5
    o, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False, scale=scale)[:2]
    lse4 = lse.reshape(*q.shape[:3], 1).contiguous()
    e = torch.empty(0, device=dev)
    aten = lambda: torch.ops.aten._scaled_dot_product_cudnn_attention_backward(do, q, k, v, o, lse4, e, e, None, None, None, N, N, 0.0, causal, scale=scale)
    ref = [x.float() for x in aten()]
    out({"case": "full", "causal": causal, "aten_nondet_ms": timed(aten, 2, 5), "fwd_ms": timed(lambda: torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False, scale=scale), 2, 5)})
    for kc in (1024, 2048, 4096, 8192):
        for gdt in (torch.bfloat16, torch.float32):
            try:
                got, ws = chunked(q, k, v, o, do, lse4, causal, scale, kc, gdt)
                again, _ = chunked(q, k, v, o, do, lse4, causal, scale, kc, gdt)
                ms = timed(lambda: chunked(q, k, v, o, do, lse4, causal, scale, kc, gdt), 1, 5)
                out({"case": "full-chunked", "causal": causal, "kc": kc, "grad_dtype": str(gdt), "ms": ms, "ws_MiB": ws / 2**20,
                     "bitwise": all(torch.equal(a, b) for a, b in zip(got, again)),
                     "maxdiff": [float((a - b).abs().max()) for a, b in zip(got, ref)]})
            except Exception as exc:
                out({"case": "full-chunked", "causal": causal, "kc": kc, "grad_dtype": str(gdt), "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
    xs = q = k = v = do = o = lse = lse4 = ref = None
    torch.cuda.empty_cache()
    # LongNet first pattern: 16 segments x 16 heads x 2048 rows, batch split and fp32 grads into strided accumulators
    xs = [torch.randn(B, N, H, D, device=dev, dtype=torch.bfloat16).view(16, 2048, H, D).transpose(1, 2) for _ in range(4)]
    q, k, v, do = xs
    o, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False, scale=scale)[:2]
    lse4 = lse.reshape(*q.shape[:3], 1).contiguous()
    aten = lambda: torch.ops.aten._scaled_dot_product_cudnn_attention_backward(do, q, k, v, o, lse4, e, e, None, None, None, 2048, 2048, 0.0, causal, scale=scale)
    out({"case": "seg", "causal": causal, "aten_nondet_ms": timed(aten, 2, 10)})
    accs = [torch.zeros(B, N, H, D, device=dev, dtype=torch.float32).view(16, 2048, H, D).transpose(1, 2) for _ in range(3)]
    for split in (1, 2, 4):
        for gdt in (torch.bfloat16, torch.float32):
            def go():
                ws = 0
                for b0 in range(0, 16, 16 // split):
                    sl = slice(b0, b0 + 16 // split)
                    if gdt == torch.float32:  # write straight into the fp32 accumulators (a fresh pattern)
                        ws = run_bwd(q[sl], k[sl], v[sl], o[sl], do[sl], lse4[sl], accs[0][sl], accs[1][sl], accs[2][sl], causal, scale)
                    else:
                        gs = [torch.empty(x[sl].shape, dtype=gdt, device=dev) for x in (q, k, v)]
                        ws = run_bwd(q[sl], k[sl], v[sl], o[sl], do[sl], lse4[sl], *gs, causal, scale)
                        for a, g in zip(accs, gs): a[sl] += g
                return ws
            try:
                ws = go()
                ms = timed(go, 2, 10)
                out({"case": "seg-det", "causal": causal, "split": split, "grad_dtype": str(gdt), "ms": ms, "ws_MiB": ws / 2**20})
            except Exception as exc:
                out({"case": "seg-det", "causal": causal, "split": split, "grad_dtype": str(gdt), "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
    xs = q = k = v = do = o = lse = lse4 = accs = None
    torch.cuda.empty_cache()
