"""The serving runner: requests -> scheduled chunks -> flattened batches -> greedy steps.

``batch`` holds requests, chunks, a step's inputs and outputs; ``scheduling`` decides which
requests run each step and preempts when the KV cache is full; ``model_runner`` ties them to the
model with the data-parallel vote. Around it: ``checks`` (what it refuses), ``modes`` (the
overlap modes it serves in), ``graphs`` (their CUDA graphs), ``drafting`` (the speculative
drafter), ``update`` (what sampled tokens do to requests) and ``warmup`` (throwaway requests).
"""

from ubatch.runner.batch import BatchInputs, Chunk, Request, StepOutput
from ubatch.runner.model_runner import ModelRunner
from ubatch.runner.scheduling import RequestScheduler

__all__ = ["BatchInputs", "Chunk", "ModelRunner", "Request", "RequestScheduler", "StepOutput"]
