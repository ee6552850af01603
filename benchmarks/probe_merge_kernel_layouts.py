"""Old (1D row vectors broadcast with [:, None]) vs new ((R, 1) tiles) merge kernel on LongNet region views: bad elements.

The old kernel is merge.py of commit 69c1976: `git show 69c1976:dilated_attention/merge.py > .gpu_tmp/merge_old.py` and
make its three relative imports absolute. Run from the repo root on a GPU (log: results/merge_kernel_layouts_h200.log).
"""
import torch, sys, os
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.join(os.getcwd(), ".gpu_tmp"))
import dilated_attention.merge as new_m
import merge_old as old_m
import triton, triton.language as tl
from dilated_attention.patterns import plan_patterns
from dilated_attention.views import region_views
dev = torch.device("cuda")
torch.manual_seed(0)
B, N, H, D = 1, 32768, 16, 128
plans = plan_patterns([2048, 4096, 32768], [1, 2, 16], seq_len=N, local_len=N, num_heads=H, num_kv_heads=H, mode="longnet")
def launch(mod, jit, out, lse, po, pl, idx, block_d, fresh):
    rank, dim = out.dim() - 1, out.shape[-1]
    sizes = [1] * (mod.MAX_LEADING - rank) + list(out.shape[:-1])
    n_rows = lse.numel(); block_r = max(1, 4096 // block_d)
    args = (out, lse, po, pl, n_rows, dim, *sizes[1:], *mod._leading(out, rank), out.stride(-1), *mod._leading(lse, rank),
            *mod._leading(po, rank), po.stride(-1), *mod._leading(pl, rank))
    jit[(triton.cdiv(n_rows, block_r),)](*args, FRESH=fresh, BLOCK_R=block_r, BLOCK_D=block_d, IDX=idx, num_warps=4)
jits = {"old": (old_m, triton.jit(old_m.merge_kernel)), "new": (new_m, triton.jit(new_m.merge_kernel))}
for pi, p in enumerate(plans):
    rows_n = N // p.dilation
    po_full = torch.randn(B, rows_n, H, D, device=dev, dtype=torch.bfloat16)
    pl_full = torch.randn(B, rows_n, H, device=dev) + 2
    base_o = torch.randn(B, N, H, D, device=dev); base_l = torch.randn(B, N, H, device=dev)
    for fresh in (False, True):
        want_o, want_l = base_o.clone(), base_l.clone()
        (ro, part), = region_views(want_o, po_full, p, True); (rl, partl), = region_views(want_l, pl_full, p, True)
        if fresh:
            mo, ml = new_m.merge_two(torch.zeros_like(ro), torch.full_like(rl, float("-inf")), part, partl)
        else:
            mo, ml = new_m.merge_two(ro, rl, part, partl)
        ro.copy_(mo); rl.copy_(ml)
        for name, (mod, jit) in jits.items():
            for idx_name, idx in (("int32", tl.int32), ("int64", tl.int64)):
                for bd in (32, 64, 128):
                    bads = []
                    for rep in range(3):
                        got_o, got_l = base_o.clone(), base_l.clone()
                        (ro, part), = region_views(got_o, po_full, p, True); (rl, partl), = region_views(got_l, pl_full, p, True)
                        launch(mod, jit, ro, rl, part, partl, idx, bd, fresh)
                        torch.cuda.synchronize()
                        bads.append(((got_o - want_o).abs() > 1e-5 * want_o.abs().max()).sum().item()
                                    + ((got_l - want_l).abs() > 1e-5).sum().item())
                    print(f"plan {pi} (w={p.segment}, r={p.dilation}) fresh={fresh!s:5s} {name} {idx_name} BLOCK_D={bd:3d}: bad elements over 3 runs {bads}", flush=True)
    # the library entry point, default config
    got_o, got_l = base_o.clone(), base_l.clone()
    (ro, part), = region_views(got_o, po_full, p, True); (rl, partl), = region_views(got_l, pl_full, p, True)
    new_m.merge_into_(ro, rl, part, partl)
    want_o, want_l = base_o.clone(), base_l.clone()
    (ro, part), = region_views(want_o, po_full, p, True); (rl, partl), = region_views(want_l, pl_full, p, True)
    mo, ml = new_m.merge_two(ro, rl, part, partl); ro.copy_(mo); rl.copy_(ml)
    print(f"plan {pi} merge_into_ (library): max rel out diff {((got_o - want_o).abs().max() / want_o.abs().max()).item():.2e}", flush=True)
