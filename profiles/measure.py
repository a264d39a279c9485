"""``python -m profiles.measure``: measure a model's per-layer costs on this machine and write a profile JSON.

Example::

    python -m profiles.measure --model gpt:layers=4,hidden=256 --device cpu --out profiles/measured/gpt4_cpu.json
    python -m sim.run --topology 2xcpu --model gpt:layers=4,hidden=256 --profile profiles/measured/gpt4_cpu.json \\
        --out runs/gpt4

writes the schema of ``profiles/README.md``: each layer's forward, backward and optimizer time
(:mod:`profiles.layer_timing`), the point-to-point latency and bandwidth between two processes (:mod:`profiles.p2p`:
gloo between CPU processes for a cpu profile, NCCL between ``cuda:0`` and ``cuda:1`` for a cuda one; skipped, with
the reason in ``method.p2p``, on a host with a single GPU, as :func:`profiles.p2p.choose_p2p` decides) and, on CUDA,
host↔device copy bandwidth (:mod:`profiles.host_copy`), plus where, with what and when it was
measured (:mod:`executor.provenance`). Bad input prints one ``error: ...`` line, exits with
status 2 and writes nothing; ``--out`` is checked before anything is measured
(:func:`sim.core.fileio.check_output_file`).
"""

from __future__ import annotations

from sim.core.errors import exit_on_interrupt_while_starting

if __name__ == "__main__":  # a Ctrl-C during the imports below is one line, not a traceback
    exit_on_interrupt_while_starting()

import argparse
import os
import socket
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from executor.nn.optim import OPTIMIZERS
from executor.nn.stages import TORCH_MODELS
from executor.provenance import catalog_id_for_gpu, cpu_model, software_versions
from profiles.layer_inputs import TENSOR_PARALLEL_MODELS
from profiles.layer_memory import measure_layer_memory
from profiles.layer_timing import LayerMeasurement, time_layers
from profiles.p2p import P2PChoice, P2PError, choose_p2p, ping_pong, power_of_two_sizes
from sim.core.cli import CliParser
from sim.core.errors import SpecError, run_cli
from sim.core.fileio import check_output_file, prepare_output_dir, write_json_atomic
from sim.core.spec import parse_spec
from sim.cost.p2p_fit import fit_latency_bandwidth
from sim.cost.profile import LayerMemory, layer_memory_fields, profile_document
from sim.hw.catalog import get_device
from sim.models import build_model
from sim.models.sharding import Sharding

__all__ = ["main", "make_parser"]


def make_parser() -> argparse.ArgumentParser:
    """The ``profiles.measure`` argument parser."""
    parser = CliParser(prog="python -m profiles.measure", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help=f"model spec with a torch implementation "
                        f"({', '.join(TORCH_MODELS)}), e.g. gpt:layers=4,hidden=256")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="where to time the layers (cuda: the current CUDA device; pick one with "
                        "CUDA_VISIBLE_DEVICES)")
    parser.add_argument("--device-name", help="catalog id written as the profile's device (default: cpu, or the "
                        "CUDA device's catalog id looked up from its name)")
    parser.add_argument("--microbatch-size", type=int, default=1, help="samples per microbatch (default 1)")
    parser.add_argument("--tp", type=int, default=1,
                        help="measure one tensor-parallel shard of each layer, as a rank of a group of TP runs it "
                        "(gpt and llama; its collectives are the simulator's to cost): the profile then applies to "
                        "plans of --tp TP only (default 1: whole layers)")
    parser.add_argument("--optimizer", choices=OPTIMIZERS, default="adam", help="optimizer whose step is timed")
    parser.add_argument("--warmup", type=int, default=3, help="untimed runs before the timed ones (default 3)")
    parser.add_argument("--repeats", type=int, default=10, help="timed runs; the median is kept (default 10)")
    parser.add_argument("--threads", type=int, help="torch intra-op threads (default 1 on cpu, matching one "
                        "executor rank per core; torch's default on cuda)")
    parser.add_argument("--seed", type=int, default=0, help="seed of weights, data and output gradients")
    parser.add_argument("--no-p2p", action="store_true", help="skip the point-to-point measurement")
    parser.add_argument("--p2p-min-bytes", type=int, default=2**10, help="smallest p2p message (default 1 KiB)")
    parser.add_argument("--p2p-max-bytes", type=int, default=2**24,
                        help="largest p2p message; sizes double from the smallest (default 16 MiB)")
    parser.add_argument("--p2p-repeats", type=int, default=50,
                        help="timed round trips per message size; the median is kept (default 50: they are cheap, "
                        "and a few slow wake-ups of a sleeping rank must not move the median)")
    parser.add_argument("--p2p-timeout", type=float, default=120.0, help="limit on the p2p measurement in s")
    parser.add_argument("--out", required=True, help="profile JSON file to write")
    return parser


def _check_args(args: argparse.Namespace) -> None:
    """Reject out-of-range numbers and an unusable ``--out`` before anything is measured."""
    for flag, value, minimum in (("--microbatch-size", args.microbatch_size, 1), ("--tp", args.tp, 1),
                                 ("--warmup", args.warmup, 0),
                                 ("--repeats", args.repeats, 1), ("--threads", args.threads, 1),
                                 ("--p2p-repeats", args.p2p_repeats, 1)):
        if value is not None and value < minimum:
            raise SpecError(f"{flag} must be >= {minimum}, got {value}")
    if not args.p2p_timeout > 0:
        raise SpecError(f"--p2p-timeout must be > 0 s, got {args.p2p_timeout}")
    check_output_file(args.out, "--out")


def _check_model(spec: str, tp: int = 1) -> str:
    """The canonical spec of ``spec``; SpecError if it is invalid, has no torch implementation, or (``tp`` > 1) has
    no tensor-parallel shards or is not divided by ``tp``."""
    graph = build_model(spec)
    name = parse_spec(graph.spec)[0]
    if name not in TORCH_MODELS:
        raise SpecError(f"model {name!r} has no torch implementation, so {graph.spec!r} cannot be measured "
                        f"(torch models: {', '.join(TORCH_MODELS)})")
    if tp > 1:
        if name not in TENSOR_PARALLEL_MODELS:
            raise SpecError(f"--tp {tp}: the executor splits only {' and '.join(TENSOR_PARALLEL_MODELS)} layers into "
                            f"tensor-parallel shards, not {name}")
        build_model(graph.spec, Sharding(tp=tp))  # a degree that does not divide the heads or widths: one line
    return graph.spec


def _resolve_device(kind: str, device_name: str | None) -> tuple[torch.device, str, str | None]:
    """``(torch device, catalog id, GPU name or None)`` for ``--device``/``--device-name``."""
    if kind == "cpu":
        return torch.device("cpu"), get_device(device_name or "cpu").name, None
    if not torch.cuda.is_available():
        raise SpecError(f"--device cuda, but torch {torch.__version__} sees no CUDA device "
                        f"(torch.cuda.is_available() is False)")
    device = torch.device("cuda", torch.cuda.current_device())
    gpu_name = torch.cuda.get_device_name(device)
    if device_name is None:
        device_name = catalog_id_for_gpu(gpu_name)
        if device_name is None:
            raise SpecError(f"the CUDA device {gpu_name!r} has no known catalog id; name it with --device-name "
                            f"(a device of profiles/hardware/devices.yaml)")
    return device, get_device(device_name).name, gpu_name


def _profile_json(args: argparse.Namespace, spec: str, device_id: str, gpu_name: str | None,
                  layers: tuple[LayerMeasurement, ...], memory: tuple[LayerMemory, ...], p2p: dict[str, Any] | None,
                  p2p_note: str, host_copy: dict[str, float] | None) -> dict[str, Any]:
    """The profile as a JSON-ready dict (schema: profiles/README.md)."""
    cuda = gpu_name is not None
    method = {
        "statistic": "median", "warmup": args.warmup, "repeats": args.repeats, "seed": args.seed,
        "p2p_repeats": args.p2p_repeats,
        "timer": "time.perf_counter" + (" between torch.cuda.synchronize() calls" if cuda else ""),
        "layers": "each layer alone on its real input; bwd_s = autograd.backward(output, seeded grad_output) "
                  "incl. the input gradient (except layer 0); the last layer's fwd_s/bwd_s include the loss",
        "p2p": p2p_note,
        "memory": "each layer alone on its real input, live tensor storages counted operator by operator "
                  "(executor.memory.StorageCounter): retained = kept from forward to backward (output and saved "
                  "tensors, input excluded); transients above the starting level, the backward's with the weight "
                  "gradients already allocated; optimizer state after one step (profiles.layer_memory)",
    }
    machine = {"hostname": socket.gethostname(), "cpu": cpu_model(), "gpu": gpu_name, "cores": os.cpu_count(),
               "threads": torch.get_num_threads()}
    # The executor's optimizer step ends with zero_grad(set_to_none=True): gradients live from a stage's first
    # backward after an update to the next update (executor.interpreter), which is what this profile is for.
    # And its gradient reduction all-reduces a flat copy of a stage's gradients (executor.data_parallel).
    extra: dict[str, Any] = {"optimizer": args.optimizer, "gradients": "per_step", "reduction": "flat_copy",
                             **({"tensor_parallel": args.tp} if args.tp > 1 else {})}
    if host_copy is not None:
        extra["host_copy"] = host_copy
    return profile_document(model=spec, device=device_id, microbatch_size=args.microbatch_size,
                            layers=[{**asdict(m), **layer_memory_fields(memory_of)}
                                    for m, memory_of in zip(layers, memory)],
                            method=method, machine=machine,
                            software=software_versions(), p2p=p2p, extra=extra)


def format_table(layers: tuple[LayerMeasurement, ...]) -> str:
    """Per-layer times in ms and sizes in MB (1e6 bytes), one row per layer plus a total."""
    rows = [f"{'layer':<12}{'fwd ms':>10}{'bwd ms':>10}{'opt ms':>10}{'param MB':>11}{'act MB':>10}"]
    for m in layers:
        rows.append(f"{m.name:<12}{m.fwd_s * 1e3:>10.3f}{m.bwd_s * 1e3:>10.3f}{m.opt_s * 1e3:>10.3f}"
                    f"{m.param_bytes / 1e6:>11.3f}{m.activation_bytes / 1e6:>10.3f}")
    total = [sum(getattr(m, key) for m in layers) for key in ("fwd_s", "bwd_s", "opt_s")]
    rows.append(f"{'total':<12}{total[0] * 1e3:>10.3f}{total[1] * 1e3:>10.3f}{total[2] * 1e3:>10.3f}"
                f"{sum(m.param_bytes for m in layers) / 1e6:>11.3f}")
    return "\n".join(rows)


def _measure_p2p(args: argparse.Namespace, choice: P2PChoice,
                 sizes: tuple[int, ...]) -> tuple[dict[str, Any], str]:
    """The profile's ``p2p`` object (with the ``backend`` and ``device`` it was measured with) and the method note;
    without a fit when the medians admit none.

    Raises:
        P2PError: the ping-pong itself failed.
    """
    backend = choice.backend
    assert backend is not None, "nothing to measure: the caller checks the choice"
    result = ping_pong(sizes, warmup=args.warmup, repeats=args.p2p_repeats, backend=backend,
                       timeout_s=args.p2p_timeout)
    p2p: dict[str, Any] = {"backend": backend, "device": choice.device, "sizes_bytes": list(result.sizes_bytes),
                           "one_way_s": list(result.one_way_s), "one_way_min_s": list(result.one_way_min_s)}
    note = (f"{choice.note}, sizes interleaved in every round, one-way = median round trip / 2; time = latency + "
            f"bytes / bandwidth fitted by least squares on relative residuals")
    try:
        latency, bandwidth = fit_latency_bandwidth(result.sizes_bytes, result.one_way_s)
    except SpecError as exc:
        # Measured data, not user input: keep the layer times (minutes of work) and the raw p2p times, drop the fit.
        print(f"warning: no p2p fit: {exc}", file=sys.stderr)
        return p2p, f"{note}; the fit failed ({exc})"
    p2p.update(latency_s=latency, bandwidth_bytes_per_s=bandwidth)
    print(f"p2p ({backend}, {choice.device}): latency {latency * 1e6:.1f} µs, bandwidth {bandwidth / 1e9:.3f} GB/s "
          f"({len(sizes)} sizes, {sizes[0]}..{sizes[-1]} bytes, median of {args.p2p_repeats})")
    return p2p, note


def _run(argv: list[str] | None) -> int:
    args = make_parser().parse_args(argv)
    _check_args(args)
    spec = _check_model(args.model, args.tp)
    device, device_id, gpu_name = _resolve_device(args.device, args.device_name)
    sizes = () if args.no_p2p else power_of_two_sizes(args.p2p_min_bytes, args.p2p_max_bytes)
    threads = args.threads if args.threads is not None else (1 if device.type == "cpu" else None)
    if threads is not None:
        torch.set_num_threads(threads)

    shard = f", one shard of tensor-parallel {args.tp}" if args.tp > 1 else ""
    print(f"measuring {spec}{shard} on {device_id} ({gpu_name or cpu_model() or 'cpu'}), microbatch size "
          f"{args.microbatch_size}, {args.optimizer}, median of {args.repeats} after {args.warmup} warm-up, "
          f"{torch.get_num_threads()} thread(s)")
    layers = time_layers(spec, microbatch_size=args.microbatch_size, optimizer=args.optimizer, warmup=args.warmup,
                         repeats=args.repeats, seed=args.seed, device=device, tp=args.tp)
    print(format_table(layers))
    memory = measure_layer_memory(spec, microbatch_size=args.microbatch_size, optimizer=args.optimizer,
                                  seed=args.seed, device=device, tp=args.tp)

    choice = choose_p2p(device.type, torch.cuda.device_count() if device.type == "cuda" else 0)
    if args.no_p2p:
        p2p, p2p_note = None, "skipped (--no-p2p)"
    elif choice.backend is None:
        p2p, p2p_note = None, choice.note
    else:
        try:
            p2p, p2p_note = _measure_p2p(args, choice, sizes)
        except P2PError as exc:
            print(f"error: {exc} (rerun with --no-p2p to skip it)", file=sys.stderr)
            return 1
    if p2p is None or "latency_s" not in p2p:
        print(f"p2p: {p2p_note}")

    host_copy = None
    if device.type == "cuda":
        from profiles.host_copy import measure_host_copy

        host_copy = asdict(measure_host_copy(device, warmup=args.warmup, repeats=args.repeats))
        print("host copy GB/s: " + ", ".join(f"{k.removesuffix('_bytes_per_s')} {v / 1e9:.2f}"
                                             for k, v in host_copy.items()))

    out = Path(args.out)
    prepare_output_dir(out.parent, "the directory of --out")  # checked before measuring; made now
    write_json_atomic(_profile_json(args, spec, device_id, gpu_name, layers, memory, p2p, p2p_note, host_copy), out)
    print(f"wrote {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status."""
    return run_cli(lambda: _run(argv))


if __name__ == "__main__":
    sys.exit(main())
