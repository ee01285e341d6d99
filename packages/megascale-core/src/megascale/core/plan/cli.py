"""``megascale plan``: the layouts of a model on a cluster, ranked by predicted speed, with their memory.

    megascale plan --model gpt3-175b --gpus 1024 --gpu a100 --global-batch 1536 --seq-len 2048
    megascale plan --hidden 12288 --layers 96 --heads 96 --vocab 51200 --gpus 1024 --global-batch 1536
    megascale plan --model config.json --gpus 64 --gpu h100 --global-batch 512 --tp 8 --pp 2   # parts fixed
    megascale plan ... --json                       # every prediction, for scripts
    megascale plan ... --emit-config run.yaml       # a LightningCLI config for the first choice
    megascale plan --calibrate [--model ... --gpus 2 ...]   # measure this machine; plan CPU ranks with it

The planner's logic lives in ``megascale.core.plan``; the ``megascale`` command (megascale-lightning)
dispatches here, and ``python -m megascale.core.plan`` runs it without Lightning.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

from megascale.core.cli_errors import UserError, report_user_errors
from megascale.core.config import GPTConfig
from megascale.core.parallel.plan import SCHEDULES
from megascale.core.plan.cluster import GPUS, ClusterSpec, gpu_spec
from megascale.core.plan.examples import EXAMPLES
from megascale.core.plan.layout import OPTIMIZER_STATES, Kernels, Workload
from megascale.core.plan.presets import PRESETS, load_model
from megascale.core.plan.search import Candidate, Fixed, search
from megascale.core.plan.shapes import model_parameters

__all__ = ["EXAMPLES", "main"]

_GB = 1e9


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="megascale plan",
        description="Rank tp × pp × dp × ZeRO × micro-batching layouts of a GPT on a cluster by predicted step "
        "time, with their memory per GPU. Fix any part of the layout to search the rest; fix all to predict one.",
        epilog="examples:\n" + EXAMPLES + "\n",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    m = p.add_argument_group("model")
    m.add_argument("--model", help=f"a preset ({', '.join(sorted(PRESETS))}), a GPTConfig YAML/JSON, a "
                   "LightningCLI config, or a Hugging Face config.json")  # fmt: skip
    m.add_argument("--hidden", type=int, help="d_model (with --layers, --heads, --vocab: the shape directly)")
    m.add_argument("--layers", type=int)
    m.add_argument("--heads", type=int)
    m.add_argument("--kv-heads", type=int)
    m.add_argument("--ffn-hidden", type=int)
    m.add_argument("--vocab", type=int)
    m.add_argument("--parallel-block", action=argparse.BooleanOptionalAction, default=None,
                   help="with the shape: parallel attention + MLP blocks (the default) or sequential ones")  # fmt: skip
    r = p.add_argument_group("run and cluster")
    r.add_argument("--gpus", type=int, help="GPUs (or, with --calibrate, CPU ranks) in all")
    r.add_argument("--gpu", default="h100",
                   help=f"GPU kind: {', '.join(sorted(GPUS))} (aliases a100, h100; default: h100)")  # fmt: skip
    r.add_argument("--gpus-per-node", type=int, default=8)
    r.add_argument("--network-gbps", type=float, help="network per node in Gb/s (default: the kind's DGX)")
    r.add_argument("--global-batch", type=int, help="sequences per optimizer step")
    r.add_argument("--seq-len", type=int, help="tokens per sequence (default: the model's max_seq_len)")
    r.add_argument("--precision", choices=["bf16-mixed", "32-true"], default="bf16-mixed")
    r.add_argument("--optimizer", choices=sorted(OPTIMIZER_STATES), default="adamw")
    f = p.add_argument_group("fixed parts of the layout (searched when left out)")
    f.add_argument("--tp", type=int)
    f.add_argument("--pp", type=int)
    f.add_argument("--dp", type=int)
    f.add_argument(
        "--cp", type=int, help="context-parallel size (searched only for sequences of 16k tokens or more)"
    )
    f.add_argument("--ep", type=int, help="expert-parallel size, a divisor of dp and of the experts (a mixture of "
                   "experts only; searched when left out)")  # fmt: skip
    f.add_argument("--zero-stage", type=int, choices=[0, 1, 2, 3])
    f.add_argument("--micro-batch-size", type=int)
    f.add_argument("--num-microbatches", type=int, help="per optimizer step (pipeline or accumulation)")
    f.add_argument("--schedule", choices=SCHEDULES)
    f.add_argument("--virtual-stages", type=int)
    f.add_argument("--sequence-parallel", action=argparse.BooleanOptionalAction, default=None)
    f.add_argument("--activation-checkpointing", choices=["none", "selective", "full"])
    o = p.add_argument_group("output")
    o.add_argument("--top", type=int, default=5, help="layouts to print (default 5)")
    o.add_argument("--json", action="store_true", help="print every prediction of the top layouts as JSON")
    o.add_argument("--emit-config", type=Path, metavar="OUT.yaml",
                   help="write a config of the first choice that `megascale fit --config OUT.yaml` runs")  # fmt: skip
    o.add_argument("--cpu-trial", type=Path, metavar="TRIAL.yaml",
                   help="write that config shrunk to run on this machine's CPU in a minute (same strategy, tp and "
                   "pp at most 2, a small model of the same kind)")  # fmt: skip
    o.add_argument(
        "--max-steps", type=int, default=1000, help="training steps of --emit-config (default 1000)"
    )
    o.add_argument("--traceback", action="store_true", help="show the full trace of an error")
    o.add_argument("--calibrate", action="store_true",
                   help="measure this machine's matmul rate, memory, gloo all-reduce bandwidth and call latencies; with "
                   "a model, plan CPU ranks with those figures")  # fmt: skip
    return p


def _model(ns: argparse.Namespace) -> GPTConfig | None:
    shape = [ns.hidden, ns.layers, ns.heads, ns.vocab]
    if ns.model and any(v is not None for v in shape):
        raise UserError("give --model or the shape (--hidden --layers --heads --vocab), not both")
    if ns.model:
        return load_model(ns.model)
    if all(v is None for v in shape):
        return None
    if any(v is None for v in shape):
        raise UserError("the shape needs all of --hidden, --layers, --heads and --vocab")
    block = {} if ns.parallel_block is None else {"parallel_block": ns.parallel_block}
    return GPTConfig(vocab_size=ns.vocab, d_model=ns.hidden, n_layers=ns.layers, n_heads=ns.heads,
                     n_kv_heads=ns.kv_heads, ffn_hidden=ns.ffn_hidden, max_seq_len=ns.seq_len or 2048, **block)  # fmt: skip


def _row(i: int, c: Candidate) -> str:
    s = c.step
    fits = f"{c.memory.total / _GB:7.1f} GB" + ("" if c.fits else " (does not fit)")
    return (f"{i:>2}  {c.layout.describe():<52} {fits:<22} {s.step_time:9.3f} {s.tokens_per_s:12,.0f} "
            f"{s.tflops_per_gpu:9.1f} {s.mfu:6.1%}  {s.limiter}")  # fmt: skip


def _why(c: Candidate) -> str:
    s = c.step
    parts = {"compute": s.compute - s.recompute, "recompute": s.recompute, "bubble": s.bubble, "tp comm": s.tp_comm,
             "cp comm": s.cp_comm, "ep comm": s.ep_comm, "pp comm": s.pp_comm, "dp comm": s.dp_comm, "optimizer": s.optimizer}  # fmt: skip
    share = ", ".join(f"{k} {v / s.step_time:.0%}" for k, v in parts.items() if v / s.step_time >= 0.005)
    mem = c.memory.peak
    return (f"      step: {share}; memory (pipeline rank {mem.pp_rank}): states {mem.states / _GB:.1f} GB, "
            f"activations {mem.activations / _GB:.1f} GB, buffers "
            f"{(mem.pipeline_buffers + mem.comm_buffers + mem.gathered_parameters) / _GB:.1f} GB")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """Run ``megascale plan`` on ``argv`` (default: the command line); the exit status (2: a usage error,
    printed in one line; ``--traceback`` shows its trace)."""
    parser = _parser()
    ns = parser.parse_args(sys.argv[1:] if argv is None else argv)
    return report_user_errors("megascale plan", lambda: _plan(ns), traceback=ns.traceback)


def _plan(ns: argparse.Namespace) -> int:
    config = _model(ns)
    calibration = None
    if ns.calibrate:
        from megascale.core.plan.calibrate import cpu_cluster, measure

        calibration = measure(threads=1, ranks=max(2, ns.gpus or 2) if (ns.gpus or 2) > 1 else 1)
        if config is None or ns.json:
            print(json.dumps({"calibration": calibration.to_dict()}, indent=2) if ns.json else
                  f"this machine, 1 thread per rank: matmul {calibration.matmul_flops / 1e9:.1f} GFLOP/s "
                  f"({calibration.dtype}), memory copy {calibration.memory_bandwidth / 1e9:.1f} GB/s, gloo all-reduce "
                  f"bus bandwidth {calibration.allreduce_bandwidth / 1e9:.2f} GB/s among {calibration.ranks} ranks, "
                  f"{calibration.call_latency * 1e6:.0f} µs per collective call, {calibration.p2p_latency * 1e6:.0f} µs "
                  "per send/receive")  # fmt: skip
        if config is None:
            return 0
    if config is None:
        raise UserError("give --model, or the shape (--hidden --layers --heads --vocab), or --calibrate")
    if ns.gpus is None or ns.global_batch is None:
        raise UserError("--gpus and --global-batch are needed to plan")
    seq_len = ns.seq_len or config.max_seq_len
    if seq_len > config.max_seq_len:
        config = replace(config, max_seq_len=seq_len)
    if calibration is not None:
        cluster = cpu_cluster(calibration, ns.gpus)
        workload = Workload(config, seq_len=seq_len, global_batch=ns.global_batch, precision="32-true",
                            optimizer=ns.optimizer, kernels=Kernels.cpu())  # fmt: skip
    else:
        gpu = gpu_spec(ns.gpu)
        network = ns.network_gbps * 1e9 / 8 if ns.network_gbps else None
        cluster = ClusterSpec(gpu, gpus=ns.gpus, gpus_per_node=ns.gpus_per_node, network_bandwidth=network)
        workload = Workload(config, seq_len=seq_len, global_batch=ns.global_batch, precision=ns.precision,
                            optimizer=ns.optimizer)  # fmt: skip
    fixed = Fixed(tp=ns.tp, pp=ns.pp, dp=ns.dp, cp=ns.cp, ep=ns.ep, zero_stage=ns.zero_stage, micro_batch_size=ns.micro_batch_size,
                  num_microbatches=ns.num_microbatches, schedule=ns.schedule, virtual_stages=ns.virtual_stages,
                  sequence_parallel=ns.sequence_parallel, activation_checkpointing=ns.activation_checkpointing)  # fmt: skip
    ranked = search(workload, cluster, fixed, top=ns.top)  # a ValueError names what cannot be laid out
    if ns.json and not ranked[0].fits:
        print(no_fit_advice(ranked[0], cluster.usable_memory), file=sys.stderr)
    if ns.json:
        out = {
            "model": config.to_dict(), "seq_len": seq_len, "global_batch": ns.global_batch,
            "cluster": {"gpu": cluster.gpu.name, "gpus": cluster.gpus, "gpus_per_node": cluster.gpus_per_node,
                        "usable_memory": cluster.usable_memory, "matmul_efficiency": cluster.gpu.matmul_efficiency,
                        "kernel_rates": cluster.gpu.kernel_rates.to_dict()},
            "calibration": calibration.to_dict() if calibration else None,
            "layouts": [c.to_dict() for c in ranked],
        }  # fmt: skip
        print(json.dumps(out, indent=2, default=str))
    else:
        n_params = model_parameters(config)
        active = (
            f", {model_parameters(config, active=True) / 1e9:.2f}B active" if config.moe is not None else ""
        )
        print(f"megascale plan: {ns.model or 'GPT'} ({n_params / 1e9:.2f}B parameters{active}), {cluster.gpus} × "
              f"{cluster.gpu.name} ({cluster.gpus_per_node} per node, {cluster.usable_memory / _GB:.0f} GB usable "
              f"each), global batch {ns.global_batch} × {seq_len} tokens")  # fmt: skip
        print(_rates_line(cluster, ranked[0]))
        print(
            f" #  {'layout':<52} {'memory/GPU':<22} {'step (s)':>9} {'tokens/s':>12} {'TFLOP/s':>9} {'MFU':>6}  limited by"
        )
        for i, c in enumerate(ranked, 1):
            print(_row(i, c))
            print(_why(c))
        if not ranked[0].fits:
            print(no_fit_advice(ranked[0], cluster.usable_memory), file=sys.stderr)
    if ns.emit_config or ns.cpu_trial:
        _emit(ns, ranked[0], config, seq_len, cluster, workload.precision)
    return 0 if ranked[0].fits else 1


def _rates_line(cluster: ClusterSpec, first: Candidate) -> str:
    """Which kernel-rate table the step times come from, and the MFU cap that bounds them."""
    rates, cap = cluster.gpu.kernel_rates, first.step.mfu_cap
    bound = f"MFU capped at {cap:.1%} (the best measured on this kind)" if cap else "no MFU cap"
    return (f"kernel rates: {rates.name} (GEMMs at {rates.matmul_efficiency:.3g} of peak); {bound}; "
            "sources: megascale.core.plan.rates, or --json")  # fmt: skip


def no_fit_advice(smallest: Candidate, usable: float) -> str:
    """Why even the layout needing least memory does not fit, and what would help: sharding the model
    states (ZeRO over the data-parallel ranks, more GPUs) when they dominate, else the activations."""
    m, plan, dp = smallest.memory.peak, smallest.layout.plan, smallest.layout.dp
    head = (f"no layout fits in {usable / _GB:.0f} GB per GPU: the smallest, {smallest.layout.describe()}, needs "
            f"{smallest.memory.total / _GB:.1f} GB (model states {m.states / _GB:.1f} GB, activations "
            f"{m.activations / _GB:.1f} GB)")  # fmt: skip
    if m.states < m.activations:
        return (head + "; the activations dominate: shorten the sequence (--seq-len), checkpoint activations "
                "(--activation-checkpointing full) or use more GPUs for tp/pp")  # fmt: skip
    fixes = []
    top_zero = 3 if plan.pp == 1 else 2
    if dp > 1 and plan.zero_stage < top_zero:
        fixes.append(
            f"a higher ZeRO stage (--zero-stage {top_zero} shards them over the {dp} data-parallel ranks)"
        )
    fixes.append("more GPUs (more data-parallel ranks for ZeRO to shard the states over, or larger tp × pp)")
    return (
        head
        + "; the model states dominate: "
        + ", or ".join(fixes)
        + " (a smaller global batch would not help)"
    )


def _emit(ns: argparse.Namespace, best: Candidate, config: GPTConfig, seq_len: int, cluster: ClusterSpec,
          precision: str) -> None:  # fmt: skip
    """--emit-config and --cpu-trial: the configs of the first choice, with the commands that run them."""
    from megascale.core.plan.emit import cpu_trial, lightning_config, preparation, to_yaml, tokenizer_for

    tokenizer = tokenizer_for(config, ns.model)
    parameters = model_parameters(config)
    emitted = lightning_config(best, config, seq_len, cluster, precision, tokenizer=tokenizer,
                               max_steps=ns.max_steps, parameters=parameters)  # fmt: skip
    prepare = preparation(tokenizer, config.vocab_size)
    out = sys.stderr if ns.json else sys.stdout
    predicted = (f"predicted {best.memory.total / _GB:.1f} GB per GPU, {best.step.step_time:.3f} s per step, "
                 f"{best.step.tflops_per_gpu:.0f} TFLOP/s per GPU on {cluster.gpus} × {cluster.gpu.name}")  # fmt: skip
    for path, config_dict, what in (
        (ns.emit_config, emitted, f"the first choice, {best.layout.describe()}; {predicted}"),
        (ns.cpu_trial, cpu_trial(emitted, best, config) if ns.cpu_trial else None,
         f"the first choice shrunk to this machine's CPU (a small model of the same kind, tp, pp <= 2), to try "
         f"the config, strategy and data before the GPUs: {best.layout.describe()} at full size"),
    ):  # fmt: skip
        if path is None or config_dict is None:
            continue
        trial = config_dict is not emitted
        steps = ["megascale-data stdlib --output .cache/megascale/stdlib"] if trial else prepare
        if (
            trial
            and config_dict["data"]["init_args"]["train"].get("tokenizer") is None
            and tokenizer != "bytes"
        ):
            what += f"; bytes (vocabulary 257) stand in for the BPE of {config.vocab_size} ids the full run trains"
        header = "\n".join([f"written by megascale plan: {what}",
                            "needs megascale-lightning and megascale-data (pip install 'megascale-data[lightning]')",
                            "run once before:", *(f"  {c}" for c in steps),
                            "then:", f"  megascale fit --config {path}"])  # fmt: skip
        Path(path).write_text(to_yaml(config_dict, header))
        print(f"wrote {path}: {'first run ' + ' && '.join(steps) + ', then ' if steps else ''}"
              f"megascale fit --config {path}", file=out)  # fmt: skip
