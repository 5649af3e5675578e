"""What a step's sampled tokens do to its requests: computed counts advance, sampled (and
accepted draft) tokens are appended, finished requests are released. Rejected drafts are
rolled back by not counting them as computed, in the target's cache and the drafter's."""

from __future__ import annotations

from ubatch.runner.batch import Chunk, Request, StepOutput
from ubatch.runner.drafting import forget_drafts
from ubatch.runner.scheduling import RequestScheduler
from ubatch.spec import DraftModel, SpecStats, accept_greedy


def update_requests(
    chunks: list[Chunk],
    tokens: list[int],
    *,
    scheduler: RequestScheduler,
    drafter: DraftModel | None,
    spec_stats: SpecStats,
) -> StepOutput:
    """Apply ``tokens`` (the step's samples, in chunk order) to the chunks' requests."""
    out = StepOutput()
    sampled = iter(tokens)
    for chunk in chunks:
        request = chunk.request
        request.num_computed = chunk.start + chunk.num_tokens
        if chunk.reaches_end:
            target_tokens = [next(sampled) for _ in range(1 + len(chunk.draft_token_ids))]
            _append(request, chunk.draft_token_ids, target_tokens, out, drafter, spec_stats)
        if request.is_finished:
            scheduler.finish(request)
            forget_drafts(drafter, request)
            out.finished[request.request_id] = request.output
    return out


def _append(
    request: Request,
    drafts: tuple[int, ...],
    target_tokens: list[int],
    out: StepOutput,
    drafter: DraftModel | None,
    spec_stats: SpecStats,
) -> None:
    """Greedy acceptance: the accepted drafts are now computed, in both caches."""
    new = accept_greedy(drafts, target_tokens)
    request.token_ids += new
    request.num_computed += len(new) - 1
    out.new_tokens[request.request_id] = new[-1]
    out.new_token_ids[request.request_id] = new
    if drafts:
        drafter.rollback(request.request_id, request.num_computed)
        spec_stats.record(len(drafts), len(new) - 1)
        out.num_draft_tokens += len(drafts)
        out.num_accepted_tokens += len(new) - 1
