"""The serving runner: requests -> scheduled chunks -> flattened batches -> greedy steps.

``batch`` holds requests, chunks, a step's inputs and outputs; ``scheduling`` decides which
requests run each step and preempts when the KV cache is full; ``model_runner`` ties them to the
model with the data-parallel vote, CUDA graphs and the speculative drafter.
"""

from ubatch.runner.batch import BatchInputs, Chunk, Request, StepOutput
from ubatch.runner.model_runner import ModelRunner
from ubatch.runner.scheduling import RequestScheduler

__all__ = ["BatchInputs", "Chunk", "ModelRunner", "Request", "RequestScheduler", "StepOutput"]
