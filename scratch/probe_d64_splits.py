"""D=64 pair rows: history split count S forced over a range, against the plan's, per shape (CUDA graphs)."""
import sys
sys.argv = ["bench_decode.py"]
sys.path.insert(0, "eval")
import torch, triton
import bench_decode as bd
from oscar_hf.kernels import triton_decode as td

plan_splits = td.plan_splits
print(torch.cuda.get_device_name(), flush=True)
copy = bd.copy_bandwidth()
for d, hq, heads in ((64, 32, 8), (128, 32, 8)):
    for batch, T in ((8, 32768), (8, 131072), (4, 131072), (1, 131072), (16, 32768)):
        n_hist = T - bd.SINK - bd.RECENT
        size = bd.packed_bytes(batch, hq, heads, d, n_hist)
        cfg = td.default_config(batch, d)
        bh = batch * heads
        planned = triton.cdiv(n_hist, plan_splits(bh, n_hist, 1, cfg, 132, 0)) if False else None
        res = []
        for h in (None, 5, 6, 7, 7.7, 8, 9, 10, 11, 12):
            if h is None:
                td.plan_splits = plan_splits
            else:
                S = max(1, int(h * 132) // bh)
                td.plan_splits = lambda bhs, n, hb, c, sm, w=0, S=S: max(1, triton.cdiv(triton.cdiv(n, S), c.block_n)) * c.block_n
            (t, _), = bd.time_configs(batch, hq, heads, d, n_hist, [cfg])[0]
            res.append((h, t * 1e3))
        td.plan_splits = plan_splits
        base = res[0][1]
        best = min(res[1:], key=lambda r: r[1])
        print(f"D{d} B={batch} T={T}: plan {base:.1f}us ({size / (base * 1e-6) / 1e9 / copy * 100:.1f}%) | "
              + " ".join(f"h{h}={t:.1f}" for h, t in res[1:])
              + f" | best h{best[0]} {best[1]:.1f}us ({size / (best[1] * 1e-6) / 1e9 / copy * 100:.1f}%)", flush=True)
