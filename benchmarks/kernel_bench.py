"""Benchmark megascale's kernels: the backend the registry selects against torch eager and torch.compile.

For each kernel (rms_norm, layer_norm, bias_gelu, swiglu, rope, cross_entropy, attention) and shape, three
paths run the same inputs:
- fused:   ``kernel(...)`` with no ``backend=``, i.e. what the model gets (apex / Triton / flash on CUDA when
           installed; ``MEGASCALE_KERNELS`` forces another, e.g. ``MEGASCALE_KERNELS=rms_norm=triton``);
- eager:   the ``torch`` reference backend, run eagerly;
- compile: ``torch.compile`` of that same reference (skip with ``--no-compile``: compiling costs ~20 s).
Two passes each: ``fwd`` (a training forward: inputs require grad) and ``fwd+bwd`` (forward, then
``torch.autograd.grad`` of every differentiable input; no ``.grad`` accumulation is timed).

Columns: time per call (ms), the time ratios fused/eager and fused/compile (below 1: fused is faster), the
forward's max |fused - eager| as a sanity check, and throughput of each path. Memory-bound kernels report
GB/s of the bytes a fused kernel must move: the forward reads its inputs and writes its output; the backward
reads the incoming gradient and the saved inputs and writes the input gradients (cross-entropy: the forward
reads the logits, the backward reads them again and writes their gradient). Attention reports TFLOP/s of
the matmuls, counting only the (query, key) pairs the causal / sliding-window mask keeps: 4·hd FLOPs per
pair per head forward, 2.5 times that backward.

Shapes: on CUDA, LLM sizes (8192-16384 tokens x hidden 4096-8192, vocabulary 128256, attention B=2, T=4096,
H=32, hd=128 with 8 KV heads, full causal and window 1024) in bf16. On the CPU (``--small``, the default
without CUDA), small shapes in fp32: about a minute with cold torch.compile caches, 20 s without compiling.
The fused GPU backends cannot run there (Triton runs on the CPU only through its test interpreter), so
"fused" is the torch reference and the table says so. GPU timing: CUDA events around back-to-back calls
after warm-up; CPU timing: the median of single calls timed with time.perf_counter.

    python benchmarks/kernel_bench.py                   # everything, sizes for this machine
    python benchmarks/kernel_bench.py --no-compile --kernels rms_norm cross_entropy
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from megascale.core import kernels
from megascale.core.kernels.registry import Kernel

KERNEL_NAMES = ["rms_norm", "layer_norm", "bias_gelu", "swiglu", "rope", "cross_entropy", "attention"]


@dataclass
class Case:
    """One benchmark problem: a kernel, its inputs, and the work one call does."""

    kernel: str
    label: str
    args: list[Any]
    kwargs: dict[str, Any]
    differentiable: list[int]
    work_fwd: float  # bytes (unit GB/s) or FLOPs (unit TFLOP/s)
    work_bwd: float
    unit: str = "GB/s"


def _size(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _leaf(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, scale: float = 1.0
) -> torch.Tensor:
    return (torch.randn(shape, device=device, dtype=torch.float32) * scale).to(dtype).requires_grad_(True)


def make_cases(
    small: bool, dtype: torch.dtype, device: torch.device, only: set[str], tiny: bool = False
) -> list[Case]:
    """The benchmark problems, built lazily per kernel so unselected ones allocate nothing. ``tiny``: toy
    shapes that only check the benchmark runs (``benchmarks/gpu.py --smoke``)."""
    if tiny:
        norm_shapes = [(64, 128)]
        ffn_shapes = [(64, 256)]
        rope_shape = (1, 32, 2, 16)
        ce_shapes = [(64, 512, 500)]
        attn = [(1, 32, 4, 2, 16, None), (1, 32, 4, 2, 16, 8)]
    elif small:
        norm_shapes = [(2048, 1024)]
        ffn_shapes = [(2048, 2816)]
        rope_shape = (2, 512, 8, 64)
        ce_shapes = [(512, 32000, 32000 - 64)]
        attn = [(1, 512, 8, 2, 64, None), (1, 512, 8, 2, 64, 128)]
    else:
        norm_shapes = [(16384, 4096), (8192, 8192)]
        ffn_shapes = [(16384, 4 * 4096), (8192, 14336)]
        rope_shape = (4, 4096, 32, 128)
        ce_shapes = [(8192, 128256, 128256), (16384, 128256, 128000)]
        attn = [(2, 4096, 32, 8, 128, None), (2, 4096, 32, 8, 128, 1024)]

    builders: dict[str, Callable[[], list[Case]]] = {}

    def norms(name: str) -> list[Case]:
        cases = []
        for M, N in norm_shapes:
            x = _leaf((M, N), dtype, device)
            w = _leaf((N,), dtype, device, scale=0.1)
            args: list[Any] = [x, w, 1e-5] if name == "rms_norm" else [x, w, _leaf((N,), dtype, device), 1e-5]
            diff = [0, 1] if name == "rms_norm" else [0, 1, 2]
            big = _size(x)
            cases.append(Case(name, f"{M}x{N}", args, {}, diff, 2 * big, 3 * big))
        return cases

    builders["rms_norm"] = lambda: norms("rms_norm")
    builders["layer_norm"] = lambda: norms("layer_norm")

    def bias_gelu() -> list[Case]:
        out = []
        for M, N in ffn_shapes:
            x = _leaf((M, N), dtype, device)
            big = _size(x)
            bias = _leaf((N,), dtype, device)
            out.append(Case("bias_gelu", f"{M}x{N}", [x, bias], {}, [0, 1], 2 * big, 3 * big))
        return out

    def swiglu() -> list[Case]:
        out = []
        for M, N in ffn_shapes:
            gate, up = _leaf((M, N), dtype, device), _leaf((M, N), dtype, device)
            big = _size(gate)
            out.append(Case("swiglu", f"{M}x{N}", [gate, up], {}, [0, 1], 3 * big, 5 * big))
        return out

    def rope() -> list[Case]:
        B, T, H, hd = rope_shape
        x = _leaf((B, T, H, hd), dtype, device)
        cos, sin = kernels.rope_tables(T, hd, 500000.0, device=device)
        big = _size(x)
        return [Case("rope", f"B{B} T{T} H{H} hd{hd}", [x, cos, sin], {}, [0], 2 * big, 2 * big)]

    def cross_entropy() -> list[Case]:
        out = []
        for M, V, vocab in ce_shapes:
            logits = _leaf((M, V), dtype, device)
            targets = torch.randint(0, vocab, (M,), device=device)
            targets[::17] = -100
            label = f"{M}x{V}" + (f" (vocab {vocab})" if vocab < V else "")
            big = _size(logits)
            kw = {"vocab_size": vocab}
            out.append(Case("cross_entropy", label, [logits, targets], kw, [0], big, 2 * big))
        return out

    def attention() -> list[Case]:
        out = []
        for B, T, H, KV, hd, window in attn:
            q = _leaf((B, T, H, hd), dtype, device)
            k, v = _leaf((B, T, KV, hd), dtype, device), _leaf((B, T, KV, hd), dtype, device)
            w = T if window is None else min(window, T)
            pairs = sum(min(i + 1, w) for i in range(T))  # (query, key) pairs the mask keeps
            flops = 4.0 * B * H * hd * pairs
            label = f"B{B} T{T} H{H}/{KV} hd{hd} " + ("causal" if window is None else f"window {window}")
            out.append(
                Case(
                    "attention",
                    label,
                    [q, k, v],
                    {"window": window},
                    [0, 1, 2],
                    flops,
                    2.5 * flops,
                    unit="TFLOP/s",
                )
            )
        return out

    builders.update(
        bias_gelu=bias_gelu, swiglu=swiglu, rope=rope, cross_entropy=cross_entropy, attention=attention
    )
    return [case for name in KERNEL_NAMES if name in only for case in builders[name]()]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_call(fn: Callable[[], Any], device: torch.device, warmup: int, iters: int) -> float:
    """Seconds per call of ``fn`` after ``warmup`` calls: the mean over ``iters`` back-to-back calls between
    two CUDA events on a GPU; the median of ``iters`` timed calls on the CPU, where other processes on a
    small machine make single calls stall."""
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / iters
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def _passes(f: Callable[..., torch.Tensor], case: Case) -> dict[str, Callable[[], Any]]:
    inputs = [case.args[i] for i in case.differentiable]
    probe = f(*case.args).detach()  # with grad on, as timed: torch.compile then builds one graph, not two
    grad_out = torch.randn_like(probe) if probe.dim() else torch.ones_like(probe)
    del probe

    def fwd() -> Any:
        return f(*case.args)

    def fwd_bwd() -> Any:
        return torch.autograd.grad(f(*case.args), inputs, grad_out)

    return {"fwd": fwd, "fwd+bwd": fwd_bwd}


def _fmt_time(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.3f}"


def _fmt_rate(case: Case, pass_name: str, seconds: float | None) -> str:
    if seconds is None:
        return "-"
    work = case.work_fwd if pass_name == "fwd" else case.work_fwd + case.work_bwd
    scale = 1e9 if case.unit == "GB/s" else 1e12
    return f"{work / seconds / scale:.3g}"


def run_case(case: Case, device: torch.device, compile_ref: bool, warmup: int, iters: int) -> list[list[str]]:
    kernel: Kernel = kernels.get_kernel(case.kernel)
    selected = kernel.select(device)
    reference = kernel.select(device, "torch").fn
    kw = case.kwargs

    def fused(*a: Any) -> torch.Tensor:
        return kernel(*a, **kw)

    def eager(*a: Any) -> torch.Tensor:
        return reference(*a, **kw)

    paths: dict[str, Callable[..., torch.Tensor]] = {"fused": fused, "eager": eager}
    errors: list[str] = []
    if compile_ref:
        torch._dynamo.reset()  # one code object (eager) is compiled per case: start each from a clean cache
        paths["compile"] = torch.compile(eager)

    times: dict[tuple[str, str], float | None] = {}
    for path, f in paths.items():
        try:
            for pass_name, fn in _passes(f, case).items():
                times[(path, pass_name)] = time_call(fn, device, warmup, iters)
        except Exception as exc:  # an OOM or a compile failure costs one cell, not the whole table
            first_line = (str(exc).splitlines() or [""])[0]
            errors.append(f"{case.kernel} {case.label} {path}: {type(exc).__name__}: {first_line}")
            times.update({(path, p): None for p in ("fwd", "fwd+bwd")})
        _sync(device)
        if device.type == "cuda":
            torch.cuda.empty_cache()

    with torch.no_grad():
        diff = (fused(*case.args).float() - eager(*case.args).float()).abs().max().item()

    rows = []
    for pass_name in ("fwd", "fwd+bwd"):
        t_fused, t_eager = times[("fused", pass_name)], times[("eager", pass_name)]
        t_comp = times.get(("compile", pass_name))
        rows.append(
            [
                case.kernel,
                case.label,
                pass_name,
                selected.name,
                _fmt_time(t_fused),
                _fmt_time(t_eager),
                _fmt_time(t_comp),
                "-" if None in (t_fused, t_eager) else f"{t_fused / t_eager:.2f}",  # type: ignore[operator]
                "-" if None in (t_fused, t_comp) else f"{t_fused / t_comp:.2f}",  # type: ignore[operator]
                f"{diff:.1e}" if pass_name == "fwd" else "",
                case.unit,
                _fmt_rate(case, pass_name, t_fused),
                _fmt_rate(case, pass_name, t_eager),
                _fmt_rate(case, pass_name, t_comp),
            ]
        )
    for line in errors:
        print(f"  ! {line}", file=sys.stderr)
    return rows


HEADER = [
    "kernel",
    "shape",
    "pass",
    "backend",
    "fused ms",
    "eager ms",
    "compile ms",
    "f/eager",
    "f/compile",
    "max|Δ|",
    "unit",
    "fused",
    "eager",
    "compile",
]


def print_table(rows: list[list[str]]) -> None:
    widths = [max(len(r[i]) for r in [HEADER, *rows]) for i in range(len(HEADER))]
    left = {0, 1, 2, 3, 10}

    def line(cells: list[str]) -> str:
        cols = (c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
        return "  ".join(cols)

    print(line(HEADER))
    print("  ".join("-" * w for w in widths))
    for r in rows:
        print(line(r))


def describe_backends(device: torch.device, names: list[str]) -> None:
    """Which backend runs each kernel here, and why each faster one does not."""
    name = f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""
    print(f"device: {device.type}{name}")
    for name in names:
        kernel = kernels.get_kernel(name)
        chosen = kernel.select(device)
        print(f"  {name:>13}: runs {chosen.name}")
        for backend in kernel.backends:
            if backend is chosen:
                break
            print(f"  {'':>13}  {backend.name} unavailable here: {backend.unavailable(device)}")
    if device.type != "cuda":
        print("  (no CUDA: the fused GPU backends cannot run here, so 'fused' below is the torch reference)")
    print()


def main(argv: list[str] | None = None) -> None:
    # The attention reference calls its lru_cache'd mask builder; Dynamo traces through the cache, which is
    # right for a pure function of (T, window, device), and says so once per run: not news for this table.
    warnings.filterwarnings("ignore", message="Dynamo detected a call to a `functools.lru_cache`")
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--small", action="store_true", default=None, help="small shapes (default without CUDA)"
    )
    parser.add_argument("--large", dest="small", action="store_false", help="LLM shapes (default on CUDA)")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile path")
    parser.add_argument("--kernels", nargs="+", choices=KERNEL_NAMES, default=KERNEL_NAMES)
    parser.add_argument(
        "--dtype",
        choices=["bf16", "fp16", "fp32"],
        default=None,
        help="default: bf16 on CUDA, fp32 on the CPU",
    )
    parser.add_argument("--warmup", type=int, default=None, help="untimed calls (default: 5 CUDA, 1 CPU)")
    parser.add_argument("--iters", type=int, default=None, help="timed calls (default: 20 CUDA, 5 CPU)")
    parser.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    args = parser.parse_args(argv)

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    on_gpu = device.type == "cuda"
    small = (not on_gpu) if args.small is None else args.small
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[
        args.dtype or ("bf16" if on_gpu else "fp32")
    ]
    warmup = args.warmup if args.warmup is not None else (5 if on_gpu else 1)
    iters = args.iters if args.iters is not None else (20 if on_gpu else 5)
    torch.manual_seed(0)

    print(
        f"megascale kernel benchmark: {'small' if small else 'LLM'} shapes, {dtype}, "
        f"{warmup} warm-up + {iters} timed calls, torch {torch.__version__}"
        + ("" if args.no_compile else ", torch.compile of the reference included")
    )
    describe_backends(device, args.kernels)

    rows: list[list[str]] = []
    started = time.perf_counter()
    for name in args.kernels:
        cases = make_cases(small, dtype, device, {name})
        while cases:  # pop each case so its tensors are freed before the next one is timed
            rows.extend(run_case(cases.pop(0), device, not args.no_compile, warmup, iters))
            gc.collect()
    print_table(rows)
    print(
        "\nf/eager, f/compile: fused time / other time (below 1: fused faster). GB/s: bytes a fused kernel"
        f" must move; TFLOP/s: masked matmul FLOPs. ({time.perf_counter() - started:.0f} s)"
    )


if __name__ == "__main__":
    main()
