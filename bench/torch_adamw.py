"""PyTorch's optimizer step on the GPU, the baseline for zp's CUDA AdamW (zp_bench_optim_cuda).

For each size (16M-1G parameters, fp32, one flat tensor as a fused optimizer sees a bucket) it
times torch.nn.utils.clip_grad_norm_ followed by torch.optim.AdamW(fused=True).step(), and the
step alone, with CUDA events (median of 20 after 3 warm-ups), and prints GB/s at 28 bytes per
parameter, the count zp's benchmark uses. Run on the GPU machine: python3 bench/torch_adamw.py
"""
import statistics

import torch


def timed(fn, reps=20, warmup=3):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def main():
    assert torch.cuda.is_available(), "needs a CUDA device"
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"{'params':>12} {'clip+step ms':>13} {'step ms':>9} {'step GB/s':>10} {'clip+step GB/s':>15}")
    for log2 in (24, 26, 28, 30):
        n = 1 << log2
        p = torch.nn.Parameter(torch.randn(n, device="cuda"))
        p.grad = torch.randn(n, device="cuda")
        opt = torch.optim.AdamW([p], lr=1e-3, weight_decay=0.01, fused=True)

        def step():
            opt.step()

        def clip_step():
            torch.nn.utils.clip_grad_norm_([p], 1.0)
            opt.step()

        t_step, t_both = timed(step), timed(clip_step)
        gb = 28.0 * n / 1e9
        print(f"{n:>12} {t_both * 1e3:>13.3f} {t_step * 1e3:>9.3f} {gb / t_step:>10.0f} {gb / t_both:>15.0f}")
        del opt, p
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
