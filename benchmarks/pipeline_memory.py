"""Benchmark pipeline memory: each rank's peak activation memory in a training step against theory, and the
last stage's memory against torch's default of keeping every microbatch's output.

For P in --ranks (default 2 and 4) one run starts P ranks (torch.multiprocessing spawn, or torchrun; gloo and
one torch thread per rank on CPU) and pipelines a megascale GPT (V·P·c blocks; a vocabulary large enough that
the logits weigh on the last stage) with megascale's ``parallelize`` under each schedule, M = 2P microbatches:
    1f1b         megascale ScheduleDecoupled1F1B (torch's 1F1B order), one stage per rank
    interleaved  torch's ScheduleInterleaved1F1B, V=2 virtual stages per rank (rank r holds r and r+P)
    gpipe        torch's ScheduleGPipe, one stage per rank

Measured, per rank, over one training step (``model(tokens, targets)``: forward and backward of every
microbatch) after one warm-up step (which builds the stages, their receive buffers and the gradients):
    saved peak   peak bytes of tensors saved for backward (megascale.core.memory_meter.SavedTensorMeter,
                 parameters ignored): the activation memory
    live peak    peak bytes of storages created during the step and alive (LiveTensorMeter): activations,
                 outputs, gradients in flight, send buffers. Not counted (allocated before the step): the
                 parameters and gradients, and the receive buffers (column "recv bufs", reported apart: the
                 pipeline's stages pool them over the microbatches in flight, all made in the warm-up step;
                 torch's PipelineStage would keep one per microbatch)
Per stage, one microbatch alone (the stage module's forward, and the loss on the last stage, outputs kept —
on the last stage only the loss, as the pipeline keeps it — then its backward), under the same meters:
    act/mb       saved bytes after the forward: the activation of one microbatch on that stage
    live/mb      live bytes after the forward (activation + the stage's output + loss), and the live peaks
                 during that forward and that backward
Theory, from the rank's computation order (recorded by ScheduleTimeline during the measured step; F adds a
microbatch of that stage to the in-flight set, B removes it):
    saved        max over the order of Σ act/mb over the in-flight (stage, microbatch) pairs: in-flight count ×
                 activation per microbatch where one stage per rank. The in-flight counts are also given in
                 closed form ("formula"): GPipe M; 1F1B min(M, P − r); interleaved, from torch's warm-up formula,
                 min((V−1)·m_r + 2(P−1−r), V·M) + 1 virtual-stage microbatches (m_r = microbatches per round, P
                 here; + 1: the first steady-state forward precedes the first backward)
    live         max over the order of (Σ live/mb over the other in-flight pairs + the send buffers the
                 schedule still holds + the peak of the action run alone): in-flight × live per microbatch +
                 the transient of the one being computed + sends. A forward sends the stage's output (extra once
                 that microbatch's backward freed it), a backward the input's gradient; torch's GPipe and
                 interleaved runtime hold every send's Work (and tensor) until the step ends,
                 ScheduleDecoupled1F1B waits the oldest of a direction once more than P are outstanding
    ratio        measured / theory (1.00 = exact). Saved comes out 0.5-1% below: storages that every microbatch
                 saves (the rotary tables; on the first and last stage the batch's tokens / targets, of which
                 the microbatches are views) count once in the step and once per microbatch in the theory
    recv theory  the receive buffers megascale.core.plan.schedule.receive_buffers counts from the rank's order
                 (per stage, activations and gradients in flight: taken when the receive is posted, one
                 microbatch ahead in the decoupled schedules, given back after the backward), × one
                 microbatch's residual stream (float32); "torch" what one per microbatch would hold

Last stage, baseline: the same step through the same schedule with torch's default ``return_outputs=True``
(what ``Pipeline.loss`` did before: the stage keeps every microbatch's output, the logits, in
``output_chunks`` until the next step, and the schedule merges them into one more copy): its peak live bytes
against ours, and what each leaves alive after the step.

    python benchmarks/pipeline_memory.py                     # CPU: pp 2 and 4, about a minute
    python benchmarks/pipeline_memory.py --ranks 2 --json /tmp/pipeline_memory.json
    torchrun --nproc-per-node 4 benchmarks/pipeline_memory.py   # one P, the launcher's
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

SCHEDULES = ("1f1b", "interleaved", "gpipe")
V = 2  # virtual stages per rank for the interleaved schedule


def _config(args: argparse.Namespace, P: int) -> Any:
    from megascale.core import GPTConfig

    return GPTConfig(vocab_size=args.vocab, d_model=args.d_model, n_layers=V * P * args.blocks_per_chunk,
                     n_heads=args.heads, max_seq_len=args.seq, pad_vocab_to_multiple_of=128)  # fmt: skip


def _in_flight_formula(name: str, P: int, M: int, rank: int) -> int:
    """The most (stage, microbatch) forwards a rank holds before their backwards, in closed form."""
    if name == "gpipe":
        return M
    if name == "1f1b":
        return min(M, P - rank)
    per_round = M // max(1, M // P)  # torch's microbatches_per_round
    warmup = min((V - 1) * per_round + 2 * (P - 1 - rank), V * M)
    return warmup + (1 if warmup < V * M else 0)


def _theory(
    order: list[tuple[str, int, int]], alone: dict[int, dict[str, int]], name: str, P: int
) -> dict[str, int]:
    """Peak saved and live bytes predicted from the rank's computation order and each stage's microbatch alone.

    Live also counts the send buffers the schedule still holds: each forward sends the stage's output (extra
    memory once that microbatch's backward has freed the output) and each backward the input's gradient. torch's
    schedules (GPipe, the interleaved runtime) keep every send's Work, and with it its tensor, until the step
    ends; ScheduleDecoupled1F1B waits the oldest send of a direction once more than P are outstanding.
    """
    in_flight: list[tuple[int, int]] = []
    sends: list[tuple[str, int, int]] = []  # (direction, stage, microbatch), oldest first
    saved = live = count = 0

    def held_sends() -> int:
        return sum(
            alone[s]["out_bytes"] if d == "F" else alone[s]["grad_bytes"]
            for d, s, mb in sends
            if d == "B" or (s, mb) not in in_flight  # an in-flight output is counted with its microbatch
        )

    def post(direction: str, stage: int, mb: int) -> None:
        if alone[stage]["out_bytes" if direction == "F" else "grad_bytes"] == 0:
            return  # the last stage sends no output, the first no gradient
        sends.append((direction, stage, mb))
        if name == "1f1b":
            mine = [x for x in sends if x[0] == direction]
            while len(mine) > P:
                sends.remove(mine.pop(0))

    for kind, stage, mb in order:
        if kind == "F":
            held = sum(alone[s]["live"] for s, _ in in_flight) + held_sends()
            live = max(live, held + alone[stage]["fwd_peak"])
            in_flight.append((stage, mb))
            saved = max(saved, sum(alone[s]["saved"] for s, _ in in_flight))
            count = max(count, len(in_flight))
        else:
            held = sum(alone[s]["live"] for s, m in in_flight if (s, m) != (stage, mb)) + held_sends()
            if name == "gpipe":  # torch's ScheduleGPipe loop variable keeps the last forward's output (the
                held += alone[stage]["logits"]  # logits on the last stage) through the backward phase
            live = max(live, held + alone[stage]["bwd_peak"])
            in_flight.remove((stage, mb))
        post(kind, stage, mb)
    return {"saved": saved, "live": live, "in_flight": count}


def _stages(schedule: Any) -> list[Any]:
    return list(getattr(schedule, "_stages", None) or [schedule._stage])


def _recv_buffer_bytes(stages: list[Any]) -> int:
    """Bytes of the activation and gradient receive buffers the stages hold (pooled, lent or in a receive)."""
    return sum(b.untyped_storage().nbytes() for stage in stages for b in stage.receive_buffers())


def _recv_theory(name: str, P: int, M: int, rank: int, args: argparse.Namespace) -> dict[str, int]:
    """Receive-buffer bytes from the planner's count of buffers in flight, and torch's one per microbatch."""
    from megascale.core.plan.schedule import receive_buffers

    v = V if name == "interleaved" else 1
    held = receive_buffers(name, P, rank, M, v)
    per_buffer = args.mb_rows * args.seq * args.d_model * 4  # one microbatch's residual stream, float32
    stages = [rank + c * P for c in range(v)]
    streams = sum((s > 0) + (s < v * P - 1) for s in stages)  # activations into s > 0, gradients into s < S-1
    return {"pooled": sum(f + b for f, b in held) * per_buffer, "torch": streams * M * per_buffer}


def _alone(
    pipe: Any, index: int, args: argparse.Namespace, tokens: torch.Tensor, targets: torch.Tensor
) -> dict:
    """One microbatch through this rank's ``index``-th stage alone: forward (+ loss), then backward."""
    from megascale.core.memory_meter import LiveTensorMeter, SavedTensorMeter

    module, stage_id = pipe.stage_modules[index], pipe.stage_ids[index]
    first, last = stage_id == 0, stage_id == pipe.num_stages - 1
    rows = args.mb_rows
    # made before the meters, as the pipeline's receive buffers are
    x = tokens[:rows] if first else torch.randn(rows, args.seq, args.d_model, requires_grad=True)
    grad = None if last else torch.randn(rows, args.seq, args.d_model)
    gc.collect()
    saved, live = SavedTensorMeter(ignore=module.parameters()), LiveTensorMeter()
    with saved, live:
        out = module(x)
        loss = pipe._scaled_loss(out, targets[:rows]) if last else None
        if last:  # the pipeline keeps the loss, whose graph holds what backward needs of the logits
            out = None
        result = {"saved": saved.current, "live": live.current, "fwd_peak": live.peak}
        live.reset_peak()
        if loss is not None:
            loss.backward()
        else:
            assert out is not None
            out.backward(grad)
        result["bwd_peak"] = live.peak
    result["out_bytes"] = 0 if out is None else out.untyped_storage().nbytes()  # what a forward sends
    result["grad_bytes"] = 0 if x.grad is None else x.grad.untyped_storage().nbytes()  # what a backward sends
    del out, loss
    if isinstance(x, torch.Tensor) and x.requires_grad:
        x.grad = None
    result["logits"] = rows * args.seq * _config(args, 1).padded_vocab_size * 4 if last else 0
    return result


def _measure(name: str, args: argparse.Namespace, rank: int, P: int) -> dict[str, Any]:
    from megascale.core import GPT
    from megascale.core.memory_meter import LiveTensorMeter, SavedTensorMeter
    from megascale.core.parallel import ParallelPlan, parallelize
    from megascale.core.parallel.pp.schedules import ScheduleTimeline

    M = args.microbatches_per_stage * P
    plan = ParallelPlan(pp=P, num_microbatches=M, schedule=name, zero_stage=0,  # type: ignore[arg-type]
                        virtual_stages=V if name == "interleaved" else 1)  # fmt: skip
    mesh = plan.dims(P).build_mesh("cpu")
    torch.manual_seed(0)
    with torch.device("meta"):
        model: Any = GPT(_config(args, P))
    pipe = parallelize(model, plan, mesh, device="cpu").pipeline
    assert pipe is not None
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, args.vocab, (M * args.mb_rows, args.seq), generator=gen)
    targets = torch.randint(0, args.vocab, (M * args.mb_rows, args.seq), generator=gen)
    model.train()
    model(tokens, targets)  # warm-up: stages, receive buffers, gradients
    schedule = pipe._schedules[("train", tuple(tokens.shape))]

    # ours: Pipeline.loss (return_outputs=False, lean stages)
    timeline = ScheduleTimeline()
    gc.collect()
    saved, live = SavedTensorMeter(ignore=model.parameters()), LiveTensorMeter()
    with timeline.attach(schedule), saved, live:
        model(tokens, targets)
    gc.collect()
    order = [(e.kind, int(e.stage or 0), int(e.microbatch or 0)) for e in timeline.compute_events()]
    ours = {"saved_peak": saved.peak, "live_peak": live.peak, "live_after": live.current}

    # baseline: torch's default return_outputs=True through the same schedule (the merged output discarded)
    step_args = (tokens,) if pipe.has_first else ()
    gc.collect()
    base = LiveTensorMeter()
    with base:
        schedule.step(*step_args, **({"target": targets, "losses": []} if pipe.has_last else {}))
    gc.collect()
    baseline = {"live_peak": base.peak, "live_after": base.current}
    schedule.step(
        *step_args, return_outputs=False, **({"target": targets, "losses": []} if pipe.has_last else {})
    )

    alone = {s: _alone(pipe, i, args, tokens, targets) for i, s in enumerate(pipe.stage_ids)}
    theory = _theory(order, alone, name, P)
    return {
        "schedule": name, "P": P, "M": M, "rank": rank, "stages": list(pipe.stage_ids),
        "has_last": pipe.has_last, "ours": ours, "torch_default": baseline, "theory": theory,
        "alone": {str(s): a for s, a in alone.items()},  # by stage (JSON keys are strings)
        "in_flight_formula": _in_flight_formula(name, P, M, rank), "order": order,
        "recv_buffers": _recv_buffer_bytes(_stages(schedule)),
        "recv_theory": _recv_theory(name, P, M, rank, args),
    }  # fmt: skip


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


def _tables(results: list[dict[str, Any]], args: argparse.Namespace) -> str:
    cfg = _config(args, 1)
    logits = args.mb_rows * args.seq * cfg.padded_vocab_size * 4
    lines = [
        f"GPT d_model={args.d_model}, vocab={cfg.padded_vocab_size}, {args.blocks_per_chunk * V} blocks per rank, "
        f"microbatch {args.mb_rows}×{args.seq} tokens (logits {_mib(logits)} MiB), M = "
        f"{args.microbatches_per_stage}·P, float32; MiB",
        "",
        "| P | schedule | rank | stages | in-flight (formula / order) | act/mb per stage | saved peak | theory "
        "| ratio | live peak | theory | ratio | recv bufs | recv theory (torch) |",
        "|---:|---|---:|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        acts = " ".join(_mib(r["alone"][str(s)]["saved"]) for s in r["stages"])
        th = r["theory"]
        lines.append(
            f"| {r['P']} | {r['schedule']} | {r['rank']} | {','.join(map(str, r['stages']))} | "
            f"{r['in_flight_formula']} / {th['in_flight']} | {acts} | {_mib(r['ours']['saved_peak'])} | "
            f"{_mib(th['saved'])} | {r['ours']['saved_peak'] / th['saved']:.3f} | {_mib(r['ours']['live_peak'])} | "
            f"{_mib(th['live'])} | {r['ours']['live_peak'] / th['live']:.3f} | {_mib(r['recv_buffers'])} | "
            f"{_mib(r['recv_theory']['pooled'])} ({_mib(r['recv_theory']['torch'])}) |"
        )
    lines += [
        "",
        "Last stage, peak live bytes in a training step: ours (return_outputs=False) vs torch's default "
        "(return_outputs=True)",
        "",
        "| P | schedule | M | ours | torch default | default / ours | alive after step: ours | torch default |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        if not r["has_last"]:
            continue
        o, b = r["ours"], r["torch_default"]
        lines.append(
            f"| {r['P']} | {r['schedule']} | {r['M']} | {_mib(o['live_peak'])} | {_mib(b['live_peak'])} | "
            f"{b['live_peak'] / o['live_peak']:.2f}x | {_mib(o['live_after'])} | {_mib(b['live_after'])} |"
        )
    return "\n".join(lines)


def _worker(rank: int, P: int, args: argparse.Namespace, init_method: str | None, out: str | None) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=P,
                            timeout=timedelta(seconds=300))  # fmt: skip
    results = []
    for name in args.schedules:
        mine = _measure(name, args, rank, P)
        gathered: list[Any] = [None] * P
        dist.all_gather_object(gathered, mine)
        results += gathered
    if rank == 0:
        if out is not None:
            Path(out).write_text(json.dumps(results))
        else:  # under torchrun
            print(_tables(results, args), flush=True)
            if args.json:
                Path(args.json).write_text(json.dumps(_summary(results, args), indent=1))
    dist.barrier()
    dist.destroy_process_group()
    if out is not None:  # spawned: gloo sometimes aborts at interpreter exit; leave without its teardown
        sys.stdout.flush()
        os._exit(0)


def _summary(results: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    return {"config": vars(args), "rows": [{k: v for k, v in r.items() if k != "order"} for r in results]}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--ranks", type=int, nargs="+", default=[2, 4], help="pipeline sizes P (not torchrun)"
    )
    parser.add_argument("--schedules", nargs="+", choices=SCHEDULES, default=list(SCHEDULES))
    parser.add_argument("--microbatches-per-stage", type=int, default=2, help="M = this × P")
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64, help="tokens per sample")
    parser.add_argument("--mb-rows", type=int, default=2, help="samples per microbatch")
    parser.add_argument(
        "--blocks-per-chunk", type=int, default=1, help="blocks per virtual stage (2 per rank)"
    )
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()

    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun: env:// rendezvous, one P
        _worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args, None, None)
        return
    import torch.multiprocessing as mp

    os.environ.setdefault("OMP_NUM_THREADS", "1")  # before the children import torch
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="megascale-pipeline-memory-") as tmp:
        for P in args.ranks:
            out = f"{tmp}/result{P}.json"
            mp.spawn(_worker, args=(P, args, f"file://{tmp}/store{P}", out), nprocs=P, join=True)
            results += json.loads(Path(out).read_text())
    print(_tables(results, args), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(_summary(results, args), indent=1))


if __name__ == "__main__":
    main()
