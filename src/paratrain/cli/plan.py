"""`paratrain plan`: predict scaling to 1..1024 devices from a bench (measure/scaling.py's ring all-reduce model)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from ..core.errors import UserError
from ..core.outputs import check_writable
from .parser import at_least_one


def add(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="predict scaling to 1..1024 devices from a bench (ring all-reduce model)")
    p.add_argument("--results", required=True, help="a bench report folder (or its results.json)")
    p.add_argument("--link", default="measured", help="pcie4, nvlink4, ib-ndr, ethernet-25g, measured "
                   "(2 local gloo processes; default), or a link.json of `paratrain doctor --out DIR`")
    p.add_argument("--bandwidth-gbs", type=float, help="explicit all-reduce bandwidth, GB/s")
    p.add_argument("--latency-us", type=float, help="explicit per-message latency, microseconds")
    p.add_argument("--per-device-batch", type=int, help="weak scaling with this batch per device "
                   "(default: the bench's global batch per device)")
    p.add_argument("--global-batch", type=int, help="strong scaling: this global batch split over the devices")
    p.add_argument("--max-devices", type=int, default=1024)
    p.add_argument("--device-memory-gb", type=float, help="a transformer's meshes: the memory of one device; the "
                   "chosen mesh is the fastest whose worker's peak (its state, activations and gathered blocks, "
                   "from the bench's measured bytes) fits it")
    p.add_argument("--out", help="folder for plan.png and plan.json")
    p.add_argument("--no-validate", action="store_true",
                   help="skip checking the model against the bench's multi-device rows (which measures this host)")
    p.set_defaults(run=run)


def _link(args: argparse.Namespace, plan: Any) -> tuple[str, float, float]:
    """The link's name, bandwidth (bytes/s) and latency (s): explicit, a named one, or measured here."""
    if (args.bandwidth_gbs is None) != (args.latency_us is None):
        raise UserError("give both --bandwidth-gbs and --latency-us, or neither")
    if args.bandwidth_gbs is not None:
        if args.bandwidth_gbs <= 0 or args.latency_us < 0:
            raise UserError("--bandwidth-gbs must be positive and --latency-us not negative")
        return "explicit", args.bandwidth_gbs * 1e9, args.latency_us * 1e-6
    if args.link == "measured":
        return "measured (2 local gloo processes)", *plan.measure_link()
    if args.link in plan.LINKS:
        return args.link, *plan.LINKS[args.link]
    if args.link.endswith(".json") or Path(args.link).is_file():  # what `paratrain doctor --out DIR` measured
        from ..measure.doctor import read_link

        return read_link(args.link)
    raise UserError(f"unknown --link '{args.link}'; choose measured, {', '.join(plan.LINKS)}, or a link.json that "
                    "`paratrain doctor --out DIR` wrote")


def _predictions(args: argparse.Namespace, plan: Any, w: Any, b: int, bw: float, lat: float) -> list[tuple]:
    """(no overlap, overlap) predictions for 1, 2, 4, ... devices, printed as a table."""
    rows, n = [], 1
    while n <= args.max_devices:
        kw = {"global_batch": args.global_batch} if args.global_batch else {"per_device_batch": b}
        rows.append((plan.predict(w, n, bw, lat, False, **kw), plan.predict(w, n, bw, lat, True, **kw),
                     plan.predict(w, n, bw, lat, True, sharded=True, **kw)))
        n *= 2
    print(f"{'devices':>8}{'ex/s (no overlap)':>20}{'efficiency':>12}{'ex/s (overlap)':>18}{'efficiency':>12}"
          f"{'fsdp ex/s (overlap)':>22}{'efficiency':>12}")
    for plain, over, sharded in rows:
        print(f"{plain['devices']:>8}{plain['examples_per_sec']:>20,.0f}{plain['efficiency']:>12.1%}"
              f"{over['examples_per_sec']:>18,.0f}{over['efficiency']:>12.1%}"
              f"{sharded['examples_per_sec']:>22,.0f}{sharded['efficiency']:>12.1%}")
    return rows


def _validate(plan: Any, results: dict, w: Any, base: dict, link: tuple[float, float], measured: bool) -> list[dict]:
    """Predict the bench's multi-device rows. CPU workers are checked against this host's measured gloo
    link and their measured co-location slowdown; GPU rows against the chosen link."""
    cpu_rows = [r for r in results["results"]
                if r["status"] == "ok" and r["family"] in plan.CPU_WORKERS and r["devices"] > 1]
    local = link if measured or not cpu_rows else plan.measure_link()
    slowdown = {r["devices"]: plan.measure_colocation(plan.bench_model(results), base["global_batch_size"],
                                                      r["global_batch_size"] // r["devices"], r["devices"],
                                                      shape=plan.bench_shape(results))
                for r in cpu_rows}
    traffic = {n: plan.measure_sharded_traffic(plan.bench_model(results), plan.bench_shape(results), n)
               for n in {r["devices"] for r in cpu_rows if r["family"].startswith("fsdp")}}
    checks = [c for c in plan.validate(results, w, *local, slowdown, traffic)
              if c["name"] in {r["name"] for r in cpu_rows}]
    checks += [c for c in plan.validate(results, w, *link) if c["name"] not in {r["name"] for r in cpu_rows}]
    if checks:
        print("validation against the bench (strong scaling at its global batch; CPU rows: measured gloo link, no "
              "overlap (gloo shares the cores with backward), compute x its measured per-worker rate on this host; "
              "fsdp's CPU rows: what sharding adds to a step, timed on this host's gloo):")
        for c in checks:
            print(f"  {c['name']:<12} measured {c['measured']:>9,.0f} ex/s  predicted {c['predicted']:>9,.0f}  "
                  f"(compute x{c['colocation_slowdown']:.2f})  error {c['error']:+.1%}")
    return checks


def _meshes(args: argparse.Namespace, results: dict, w: Any, base: dict, bw: float, lat: float) -> list[dict]:
    """A transformer's meshes of 1, 2, 4, ... devices, the fastest whose worker's peak fits chosen
    (measure/meshes.py)."""
    from ..measure import meshes

    if args.device_memory_gb is not None and args.device_memory_gb <= 0:
        raise UserError("--device-memory-gb must be positive")
    model = meshes.of_bench(results)
    if model is None:
        return []
    memory = args.device_memory_gb * 1e9 if args.device_memory_gb else None
    return meshes.print_tables(w, model, args.max_devices, args.global_batch or base["global_batch_size"], bw, lat,
                               memory, meshes.measured_bytes(results, base, model))


def run(args: argparse.Namespace) -> int:
    from ..measure import scaling as plan

    if args.out:
        check_writable(args.out)
    results = plan.load_results(args.results)
    w, base = plan.workload_from_bench(results)
    at_least_one(args, "per_device_batch", "global_batch", "max_devices")
    link, bw, lat = _link(args, plan)
    b = args.per_device_batch or base["global_batch_size"]
    print(f"workload: {w.compute_per_example_s * 1e6:.1f} us compute per example and {w.fixed_per_step_s * 1e3:.2f}"
          f" ms fixed per step (bench row {base['name']}), {w.grad_bytes * w.trained / 1e6:.2f} MB of gradients"
          + (f" (the adapters': --lora trains {w.trained:.1%} of the {w.grad_bytes / 1e6:.2f} MB of weights)"
             if w.trained < 1 else ""))
    cost = plan.model_cost(results)
    if cost is not None:  # a language model: what its compute is worth, in tokens and FLOPs
        per_example = cost["flops_per_token"] * cost["tokens"]
        print(f"model: {cost['flops_per_token'] / 1e6:.3g} MFLOPs a trained token ({cost['counted']}), "
              f"{cost['tokens']} tokens an example: {per_example / w.compute_per_example_s / 1e9:.1f} GFLOP/s in the "
              f"measured compute; tokens/s below = ex/s x {cost['tokens']}")
    print(f"link: {link}: {bw / 1e9:.2f} GB/s, {lat * 1e6:.1f} us per message; ring all-reduce "
          "2(N-1)/N x bytes / bandwidth + 2(N-1) x latency")
    print("assumptions: compute per example is constant (linear in the batch); one more 24-byte all-reduce per "
          "step (loss and stop flags); with overlap the gradient all-reduce hides in the backward pass "
          f"({plan.BACKWARD_FRACTION:.0%} of compute); fsdp moves {(2 + w.trained) / 2:.3g}x the bytes "
          f"(weights all-gathered in forward and backward, gradients reduce-scattered; {w.blocks} blocks, a message "
          "each), hides them behind all of the compute, and updates 1/N of the weights; "
          + (f"strong scaling, global batch {args.global_batch}" if args.global_batch
             else f"weak scaling, {b} examples per device"))
    rows = _predictions(args, plan, w, b, bw, lat)
    meshes = _meshes(args, results, w, base, bw, lat)
    checks = [] if args.no_validate else _validate(plan, results, w, base, (bw, lat), args.link == "measured")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "plan.json").write_text(json.dumps({"link": link, "bandwidth": bw, "latency": lat, "rows": rows,
                                                   "meshes": meshes, "validation": checks}, indent=2) + "\n")
        from ..core.optional import how_to_install, installed
        from ..measure.plot import plan_curve

        if installed("matplotlib"):
            plan_curve(rows, out / "plan.png", link)
            print(f"plan: {out / 'plan.png'}")
        else:
            print(f"plan: {out / 'plan.json'} (no plan.png: matplotlib is not installed; "
                  f"{how_to_install('matplotlib')})")
    return 0
