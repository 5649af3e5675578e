"""Two lanes for a chain of expert stages (expert groups, token runs): every other stage's GEMMs
run on a second stream beside the current one, on the same SMs, so one stage's tiles fill the
SMs the other's last wave leaves idle.

Why: a grouped GEMM runs in waves of tiles over the SMs, and cutting one call into k leaves k
partly filled last waves. Two groups of four experts in turn took 1.08-1.10x one call over eight
at 1024-2048 decode tokens, beside each other 0.96-1.00x (one H100, four layers replayed from a
graph: ``scripts/bench_expert_groups.py``).

Only for short stages: a stage of more than ``MAX_STAGE_ROWS`` rows (padding included, over all
its experts) fills the SMs for many waves, and beside the next stage it only runs longer, so its
combine starts later. In moe-bench prefill at 4096 tokens as one rank of eight, ``split2+tokens2``
(token runs of about 2700 rows a ubatch) took 29.3 ms on two lanes against 25.9 in turn (same H100,
FULL graphs), 29.1 on two lanes on another machine and 25.8 in turn on a third; in decode, at up
to about 1000 rows a stage, two lanes gain (above). Between the two the bound is coarse: prefill
runs of about 1800 rows lost on two lanes, of about 1350 gained (neither beat two runs in turn).

Only what a stage computes from its received rows runs on the second lane; what it writes into
shared outputs (sums over groups, combines) stays on the current stream, in stage order, after
the current stream waits for the lane. Before each odd stage the lane waits for the current
stream as it stood when the even stage before opened, and for its own stage's collective: so
its GEMMs can start while that even stage still runs, yet only after the current stream read
what the lane's previous stage made (a block the lane frees is reused on the lane only, so it
is never written while the current stream still reads it). Lanes run on CUDA outside PIECEWISE
recording, whose pieces are separate graphs (an event recorded in one piece cannot be waited in
another); elsewhere every stage runs in turn on the current stream. A stage's GEMMs may write
state shared by every stage only atomically (the dropped-rows counter is added to so).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from ubatch import islands
from ubatch.streams import beside_stream

MAX_STAGE_ROWS = 2048  # a stage's rows (padding included), above which stages run in turn


class GemmLanes:
    """Opened where a chain of ``stages`` starts (``stage`` each in turn, index 0 first), whose
    GEMMs take ``rows`` rows in all (padding included)."""

    def __init__(self, device: torch.device, stages: int, *, rows: int) -> None:
        self._side: torch.cuda.Stream | None = None
        short = rows <= MAX_STAGE_ROWS * stages
        if stages > 1 and short and device.type == "cuda" and not islands.recording_active():
            self._main = torch.cuda.current_stream(device)
            self._side = beside_stream(self._main)
            self._opened: torch.cuda.Event | None = None

    @contextmanager
    def stage(self, index: int, collectives: Iterable[Any]) -> Iterator[None]:
        """Run stage ``index``'s GEMMs in the with block once its ``collectives`` (handles, None
        for done) landed: odd stages on the second lane, which the current stream waits for when
        the block ends; even ones, and all without a second lane, on the current stream. Stage
        i's consumers (its sums, its combine) are issued before stage i + 1 opens."""
        if self._side is None or index % 2 == 0:
            if self._side is not None:
                self._opened = self._main.record_event()
            for handle in collectives:
                if handle is not None:
                    handle.wait()
            yield
            return
        if self._opened is None:
            raise RuntimeError(f"expert stage {index} opened before stage 0: stages run in order")
        self._side.wait_event(self._opened)
        for handle in collectives:
            if handle is not None:
                handle.wait(stream=self._side)
        with torch.cuda.stream(self._side):
            yield
        self._main.wait_stream(self._side)
