"""The MoE dispatch's per-destination count on one H200: the old cumsum down a [T*k, 2] one-hot
(an outer-dim scan) against the new scan along one contiguous row per destination. Same result,
checked; eager time per call (launches included), 50 calls after 3 warm-ups."""

import torch

dev = "cuda"
for tk in (512, 2048, 8192):
    dest = torch.randint(0, 2, (tk,), device=dev)
    ranks = torch.arange(2, device=dev)[:, None]

    def old():
        oh = torch.nn.functional.one_hot(dest, 2)
        return (oh.cumsum(0) * oh).sum(-1) - 1

    def new():
        return (dest == ranks).cumsum(1).gather(0, dest[None])[0] - 1

    assert torch.equal(old(), new())
    for name, f in (("old", old), ("new", new)):
        for _ in range(3):
            f()
        s = torch.cuda.Event(enable_timing=True)
        e = torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        s.record()
        for _ in range(50):
            f()
        e.record()
        torch.cuda.synchronize()
        print(tk, name, round(s.elapsed_time(e) / 50 * 1000, 1), "us per call")
