"""Probe (H200 run, `benchmarks/results/cudnn_frontend_probe_h200.log`): cuDNN frontend deterministic SDPA backward vs torch aten cuDNN backward on the library's strided views.

Run: `pip install nvidia-cudnn-frontend==1.22.1` (and 1.16.0), then `python benchmarks/probe_cudnn_frontend.py` from the repo root.
"""
import os, sys, json, time
import torch
sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks"))
from bench_kernel import timed
import cudnn
print("cudnn frontend", getattr(cudnn, "__version__", "?"), "backend", cudnn.backend_version(), "torch cudnn", torch.backends.cudnn.version(), flush=True)
dev = torch.device("cuda")
handle = cudnn.create_handle()
cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream().cuda_stream)
DT = {torch.bfloat16: cudnn.data_type.BFLOAT16, torch.float16: cudnn.data_type.HALF}

def build(q, k, v, o, do, lse4, causal, scale, det):
    g = cudnn.pygraph(io_data_type=DT[q.dtype], intermediate_data_type=cudnn.data_type.FLOAT,
                      compute_data_type=cudnn.data_type.FLOAT, handle=handle)
    t = {n: g.tensor_like(x) for n, x in dict(q=q, k=k, v=v, o=o, do=do, stats=lse4).items()}
    dq, dk, dv = g.sdpa_backward(q=t["q"], k=t["k"], v=t["v"], o=t["o"], dO=t["do"], stats=t["stats"],
                                 attn_scale=scale, use_causal_mask=causal, use_deterministic_algorithm=det)
    outs = [torch.empty_like(x) for x in (q, k, v)]
    for gt, x in zip((dq, dk, dv), outs):
        gt.set_output(True).set_dim(list(x.shape)).set_stride(list(x.stride())).set_data_type(DT[q.dtype])
    g.validate(); g.build_operation_graph()
    g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK]); g.check_support(); g.build_plans()
    ws = torch.empty(g.get_workspace_size(), device=dev, dtype=torch.uint8)
    pack = {t["q"]: q, t["k"]: k, t["v"]: v, t["o"]: o, t["do"]: do, t["stats"]: lse4, dq: outs[0], dk: outs[1], dv: outs[2]}
    def run():
        g.execute(pack, ws, handle=handle)
        return outs
    return run, ws.numel()

def aten_bwd(q, k, v, o, do, lse4, causal, scale):
    e = torch.empty(0, device=dev)
    return lambda: torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        do, q, k, v, o, lse4, e, e, None, None, None, q.shape[2], k.shape[2], 0.0, causal, scale=scale)

def case(name, make, causal):
    torch.manual_seed(0)
    q, k, v, do = make()
    scale = q.shape[-1] ** -0.5
    o, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False, scale=scale)[:2]
    lse4 = lse.reshape(*q.shape[:3], 1).contiguous()
    res = {"case": name, "causal": causal, "shape": list(q.shape), "q_stride": list(q.stride())}
    try:
        fwd = lambda: torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False, scale=scale)
        res["fwd_ms"] = timed(fwd, 3, 10)
        a = aten_bwd(q, k, v, o, do, lse4, causal, scale)
        ref = [x.clone() for x in a()]
        res["aten_ms"] = timed(a, 3, 10)
        res["aten_bitwise_5"] = all(all(torch.equal(x, y) for x, y in zip(ref, a())) for _ in range(5))
        for det in (True, False):
            t0 = time.perf_counter()
            run, ws = build(q, k, v, o, do, lse4, causal, scale, det)
            tag = "det" if det else "nondet"
            res[f"{tag}_build_s"] = round(time.perf_counter() - t0, 2)
            res[f"{tag}_ws_MiB"] = ws / 2**20
            got = [x.clone() for x in run()]
            res[f"{tag}_ms"] = timed(run, 3, 10)
            res[f"{tag}_bitwise_5"] = all(all(torch.equal(x, y) for x, y in zip(got, run())) for _ in range(5))
            res[f"{tag}_maxdiff_vs_aten"] = [float((x.float() - y.float()).abs().max()) for x, y in zip(got, ref)]
            res[f"{tag}_refmax"] = [float(y.float().abs().max()) for y in ref]
    except Exception as exc:
        res["error"] = f"{type(exc).__name__}: {str(exc)[:400]}"
    print(json.dumps(res), flush=True)

B, N, H, D = 1, 32768, 16, 128
def full():
    xs = [torch.randn(B, N, H, D, device=dev, dtype=torch.bfloat16) for _ in range(4)]
    return [x.transpose(1, 2) for x in xs]  # BSHD storage, (B,H,N,D) views
def seg2048():
    xs = [torch.randn(B, N, H, D, device=dev, dtype=torch.bfloat16) for _ in range(4)]
    return [x.view(16, 2048, H, D).transpose(1, 2) for x in xs]
def diag16():  # w=32768, r=16: chunk c = head c at offset c, stacked in the batch dim (stride H*D + D)
    xs = [torch.randn(B, N, H, D, device=dev, dtype=torch.bfloat16) for _ in range(4)]
    return [x.as_strided((16, 1, 2048, D), (H * D + D, D, 16 * H * D, 1)) for x in xs]
def dil4():  # w=8192, r=4: 4 segments of 2048 rows x 4 heads per offset chunk, stacked: one offset chunk (offset 1, heads 4..8)
    xs = [torch.randn(B, N, H, D, device=dev, dtype=torch.bfloat16) for _ in range(4)]
    return [x.view(4, 2048, 4, H, D)[:, :, 1, 4:8].transpose(1, 2) for x in xs]
for causal in (False, True):
    for name, make in (("full32768", full), ("seg2048x16", seg2048), ("diag_r16", diag16), ("dil_r4_chunk", dil4)):
        case(name, make, causal)
