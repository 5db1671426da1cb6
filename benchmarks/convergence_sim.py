"""``convergence.py --backend sim``: the same training with every engine in one thread.

No network: an exact butterfly in memory (each sender's and each owner's encoding, with error
feedback as the averager keeps it), blocking rounds, and the final ``average_parameters()``
flow answered in memory.
"""

from __future__ import annotations

import argparse
import time

import torch
from convergence import Recorder, generator, make_optimizer, outer_options
from convergence_task import evaluate, make_model, sample
from torch import nn


def run_simulated(mode: str, codec: str, seed: int, args: argparse.Namespace, test) -> dict:
    """The same training in one thread: N engines, blocking rounds, an exact butterfly in memory.

    Each peer encodes its vector with error feedback, the part owners average the decoded
    values and encode the mean with their own error feedback (as the butterfly all-reduce
    does; a pair under a sparse codec applies the mean of the two payloads as it is, as a
    pair's round does: ``swarm.averaging.butterfly.pairs``); bytes per peer per round are
    2(N-1)/N x the payload. Where the engine keeps what its payloads leave out in its model
    (sparse codecs), each sender's residual restarts at zero every round and goes back to the
    engine, as the butterfly's does. No network, no overlap.
    """
    from swarm.averaging.butterfly.pairs import is_pairwise
    from swarm.compression import get_codec
    from swarm.compression.feedback import ErrorFeedback
    from swarm.config import SwarmConfig
    from swarm.training.engine import TrainingEngine
    from swarm.training.rounds import RoundOutcome

    n = args.peers
    inner = 1 if mode == "gradients" else args.inner_steps
    config = SwarmConfig.build(
        mode=mode, inner_steps=inner, codec=codec, overlap=False, **outer_options(args)
    )
    engines, schedules = [], []
    for _ in range(n):
        model = make_model(seed)
        opt, schedule = make_optimizer(model, args)
        engines.append(TrainingEngine(model, opt, config))
        schedules.append(schedule)
    feedback = [ErrorFeedback(get_codec(codec)) for _ in range(n + 1)]  # the last: the owner
    gens = [generator(seed, r) for r in range(n)]
    rec, start = Recorder(n), time.perf_counter()

    def average(plans: list) -> list:
        """Average the plans' tensors in place; the residuals the engines keep (else Nones)."""
        for f, p in zip(feedback[:n], plans, strict=True):
            if p.keep_unsent:  # the engine keeps what was left out in its model (as on sockets)
                f.reset()
        senders = [f.encode for f in feedback[:n]]
        weights = [p.weight for p in plans]
        # a pair exchanges its members' own payloads: the mean is not encoded again
        pair = is_pairwise(True, feedback[n].codec, n)
        owner = None if pair else feedback[n].encode
        sent = exact_butterfly([p.tensors for p in plans], weights, senders, owner)
        for r in range(n):
            rec.bytes[r] += int(2 * (n - 1) / n * sent)
        return [
            f.residual.clone() if p.keep_unsent else None
            for f, p in zip(feedback[:n], plans, strict=True)
        ]

    for step in range(1, args.steps + 1):
        due = False
        for e, g in zip(engines, gens, strict=True):
            x, y = sample(args.batch, g)
            nn.functional.cross_entropy(e.model(x), y).backward()
            due = e.count(args.batch)
            if mode != "gradients":
                e.inner_step()
        if due:
            plans = [e.begin_round() for e in engines]
            unsent = average(plans)
            for r, (e, plan) in enumerate(zip(engines, plans, strict=True)):
                outcome = RoundOutcome(True, n, 0, 0, unsent=unsent[r])
                rec.count(r, e.finish_round(plan, outcome))
                if mode == "gradients":
                    e.inner_step()
        for e, schedule in zip(engines, schedules, strict=True):
            e.optimizer.zero_grad(set_to_none=True)
            schedule.step()
        if step % args.eval_every == 0 or step == args.steps:
            for r, e in enumerate(engines):
                rec.evaluate(r, step, e.model, test)
    for r, e in enumerate(engines):
        rec.before_final[r] = evaluate(e.model, test)
    final_average(engines, rec)
    for r, e in enumerate(engines):  # replaces the last evaluation, as on sockets
        rec.evaluate(r, args.steps, e.model, test)
    result = rec.result(args.batch * n, args.last_evals)
    result["wall_s"] = time.perf_counter() - start
    return result


def final_average(engines: list, rec: Recorder) -> None:
    """``average_parameters()`` of every engine in memory: each plan's codec without residuals
    (rounds of values keep none), skipped where ``unless_equal`` and the values agree, the
    anchors averaged too where the plan syncs them and they differ; then the buffers' round."""
    from swarm.averaging.butterfly.pairs import is_pairwise
    from swarm.compression import get_codec
    from swarm.training.final_average import average_values
    from swarm.training.rounds import RoundOutcome

    def average(lists: list, codec: str | None) -> int:
        """Average the lists of tensors in place, encoded without residual (the mean not
        encoded again in a pair, as for training rounds); payload bytes."""
        c = get_codec(codec or "none")
        owner = None if is_pairwise(True, c, len(lists)) else c.encode
        return exact_butterfly(lists, [1.0] * len(lists), [c.encode] * len(lists), owner)

    def run_round(plans: list) -> int:
        """One round of ``plans`` (and their syncs), as the averager would run it: bytes."""
        sent, n = 0, len(plans)
        if not (
            plans[0].unless_equal
            and all(torch.equal(flat(p.tensors), flat(plans[0].tensors)) for p in plans)
        ):
            sent += average([p.tensors for p in plans], plans[0].codec)
        syncs = [p.sync for p in plans if p.sync]
        if len(syncs) == n and not all(torch.equal(flat(s), flat(syncs[0])) for s in syncs):
            sent += average(syncs, plans[0].sync_codec)
        return sent

    # every engine's average_parameters() flow, in step: the same rounds in the same order
    def answer(flow, outcome: RoundOutcome):
        try:
            return flow.send(outcome)
        except StopIteration:
            return None

    flows = [average_values(e) for e in engines]
    plans, sent = [next(f) for f in flows], 0
    while all(p is not None for p in plans):
        sent += run_round(plans)
        plans = [answer(f, RoundOutcome(True, len(engines), 0, 0)) for f in flows]
    for r in range(len(engines)):
        rec.final_bytes[r] = int(2 * (len(engines) - 1) / len(engines) * sent)
        rec.bytes[r] += rec.final_bytes[r]


def flat(tensors: list) -> torch.Tensor:
    return torch.cat([t.flatten() for t in tensors])


def exact_butterfly(lists: list, weights: list, senders: list, owner) -> int:
    """What a butterfly round leaves every member with, in memory: each list of tensors encoded
    by its sender (``senders[i]``), the weighted mean of the decoded vectors encoded by the
    owner (as it is where ``owner`` is None: a pair), decoded into every list in place.
    Returns the largest payload's bytes."""
    from swarm.compression import decode

    payloads = [encode(flat(ts)) for encode, ts in zip(senders, lists, strict=True)]
    mean = sum(w * decode(b).float() for w, b in zip(weights, payloads, strict=True))
    mean = mean / sum(weights)
    values = mean if owner is None else decode(owner(mean)).float()
    for ts in lists:
        offset = 0
        for t in ts:
            t.copy_(values[offset : offset + t.numel()].view_as(t))
            offset += t.numel()
    return max(map(len, payloads))
