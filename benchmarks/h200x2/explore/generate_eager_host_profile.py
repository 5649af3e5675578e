"""Host profile of eager generation: plain vs truncated-drafter k=2 (dense-bench, 1 GPU)."""

import cProfile
import io
import pstats
import time

import torch

from ubatch.bench.generation import GenerationShape, capture_sizes_for, generation_runner, make_drafter
from ubatch.models import ModelConfig, build_model

dev = torch.device("cuda", 0)
cfg = ModelConfig.preset("dense-bench")
model = build_model(cfg, device=dev)
shape = GenerationShape(32, 128, 64)
sizes = capture_sizes_for(shape, 4)
prompts = shape.prompts(cfg.vocab_size)
for label, drafter, k in [
    ("plain", None, 0),
    ("truncated2", make_drafter("truncated", model, cfg), 2),
    ("plain-again", None, 0),
]:
    r = generation_runner(model, cfg, shape, graphs=False, capture_sizes=sizes, num_ubatches=1, drafter=drafter, k=k)
    r.generate(prompts, 4)
    torch.cuda.synchronize()
    steps = [0]
    orig = r.step

    def counted():
        steps[0] += 1
        return orig()

    r.step = counted
    pr = cProfile.Profile()
    t = time.perf_counter()
    pr.enable()
    r.generate(prompts, shape.max_new_tokens)
    torch.cuda.synchronize()
    pr.disable()
    dt = time.perf_counter() - t
    r.close()
    print(f"=== {label}: {dt:.3f} s, {steps[0]} steps, {dt / steps[0] * 1e3:.1f} ms/step", flush=True)
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(14)
    print(s.getvalue()[-3500:], flush=True)
